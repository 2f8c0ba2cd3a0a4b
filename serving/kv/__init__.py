"""The paged KV cache: page tables and allocation (``pages``), swap to host
memory (``swap``) and automatic prefix caching (``prefix_cache``)."""
