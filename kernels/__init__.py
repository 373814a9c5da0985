"""kernels: Triton / TileLang GPU kernels, each file beside its torch reference and a wrapper that
checks shapes, dtypes and contiguity."""
