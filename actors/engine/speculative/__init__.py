"""Speculative decoding inside the batch (the verify pass, the speculative runner, MTP, lookup drafters) and SpecPrefill."""
