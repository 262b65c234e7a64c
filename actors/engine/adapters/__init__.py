"""LoRA adapters chosen per request over one loaded base: their files (``files``), the
per-row update inside the base's linear layers (``multi_lora``), and the resident set
with its slots, LRU and pins (``bank``)."""
