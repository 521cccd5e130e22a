"""Zephon inside training frameworks: each submodule plugs the one save path (fenced, catalogued,
marker last) into a framework's own checkpoint hooks, and answers its "where do I resume" with
the latest complete checkpoint.

Submodules import their framework lazily; ``import zephon.integrations`` imports none of them.
"""
