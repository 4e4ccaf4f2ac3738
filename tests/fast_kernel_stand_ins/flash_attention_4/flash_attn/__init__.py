"""Stand-in for flash-attn-4's `flash_attn` package, of which transformers imports only `flash_attn.cute`."""
