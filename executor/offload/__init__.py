"""Host-memory and on-disk residence for weights too large for the GPU (experts, PLE n-gram tables)."""
