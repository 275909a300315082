"""The prefix cache: states left by earlier prompts, reused by prompts that continue them.

`cache.py` holds them in memory, found through a radix trie (`trie.py`); `disk.py` keeps
what memory evicts in a folder (`files.py`: one entry's files; `folders.py`: which files
are the server's; `check.py`: what a state read back must pass)."""
