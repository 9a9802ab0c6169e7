"""Semantic code search: chunking, embeddings, vector and lexical indexes, incremental sync.

Public entry points (everything heavy is imported by the modules that need it, not here):
- `index.code_index.CodeIndex(root).sync()` / `.search(query, k, path=...)`: the library API.
- `index.cli.main_index(argv, root)` / `main_search(argv, root)`: `composer-agent index|search`.

Modules: files (what is indexed), languages + chunker (tree-sitter chunks; doc prose kept apart),
embed (sentence-transformers for indexing, numpy_bert for queries without torch), lexical (BM25 over
code and over doc prose), fusion, store (on-disk layout, atomic commits), code_index.
"""
