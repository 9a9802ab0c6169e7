"""Semantic code search: chunking, embeddings, vector and lexical indexes, incremental sync."""
