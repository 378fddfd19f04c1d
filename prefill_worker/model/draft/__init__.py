"""Draft models that run after the target's forward (speculative decoding under PD): their
weights, their pools and their first proposal (``mtp``: DeepSeek-V3's MTP layer; ``eagle``:
EAGLE and EAGLE-3 drafts of a Llama-family target)."""
