"""The I/O under `pack_dataset`, private to `llm_packing.data`.

- `token_columns`: token and label columns read where they lie in a memory-mapped Arrow table, and their value checks;
- `gather`: the packed rows of a group gathered from those columns in input order;
- `gather_processes`: the same gather split over forked processes (`num_proc`);
- `packed_cache`: the `datasets` cache file of a packed split (writer threads, loading, shards);
- `direct_writes`: writes past the page cache (O_DIRECT, or drop-behind);
- `resident_pages`: giving a memory-mapped input's pages back as they add up.

May import: `llm_packing.core`, `llm_packing.errors`, numpy and pyarrow.
"""
