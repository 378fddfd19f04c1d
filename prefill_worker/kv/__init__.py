"""KV bookkeeping (torch-free): page pool, request-to-page tables, aux rows, pool layout."""
