"""Drivers: load a code object, launch a kernel by name. One per platform."""
