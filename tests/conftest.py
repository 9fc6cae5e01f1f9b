import os

# Kernels run in Triton's interpreter on CPU; set before any generated module is
# imported (the @triton.jit decorator reads it then).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FLASHGEN_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".flashgen_cache"))
