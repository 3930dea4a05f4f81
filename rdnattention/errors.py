"""Every error the runtime raises; each message says what was wrong and what is accepted."""


class RdnaAttentionError(Exception):
    """Base class of all rdnattention errors."""


class InvalidArgumentError(RdnaAttentionError, ValueError, RuntimeError):
    """An argument has the wrong shape, dtype, device, layout or value. Also a RuntimeError, the
    type flash-attn's and torch's C++ argument checks raise, so code written against them catches it."""


class UnsupportedError(RdnaAttentionError, NotImplementedError):
    """A valid request that no built kernel or driver serves (e.g. an unlisted head_dim)."""


class KernelsNotBuiltError(RdnaAttentionError, FileNotFoundError):
    """No built kernels were found for the device; the message names the command to run."""


class IncompatibleKernelsError(KernelsNotBuiltError):
    """Built kernels exist but this runtime cannot use them: damaged or inconsistent files, or
    kernels of another version (see StaleKernelsError)."""


class StaleKernelsError(IncompatibleKernelsError):
    """Kernels built by another version (table format or argument layout differ). Another table on
    the search path that serves the target is used instead, with a warning; this is raised when
    none does."""


class LaunchError(RdnaAttentionError, RuntimeError):
    """The driver refused or failed a launch."""
