"""Mooncake-style distributed KV pool: block keys, pool nodes, metadata, transfer."""
