"""CPU-backend speed-ups behind contracts checked at load: chunked GatedDeltaNet prefill, OpenBLAS threads."""
