"""csrc: native C++/CUDA ops built with torch extension tooling, each with a torch fallback."""
