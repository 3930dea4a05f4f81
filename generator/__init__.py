"""rdnattention kernel generator: variants.yaml -> specs -> sources -> ninja -> audit."""
