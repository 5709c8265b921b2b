"""Weight-only int4/int8, the integer GEMM and the int8 KV cache."""
