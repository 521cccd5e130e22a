"""The role views of ``Catalog``: one module per role, each a mixin over
``catalog.session_base.CatalogBase`` that ``catalog.catalog.Catalog`` composes.

A role module validates the arguments of its public methods, opens each call's transaction
with ``CatalogBase``'s helpers and leaves the row work to the internal modules of the package
(``catalog.runs``, ``catalog.attempts``, ``catalog.transitions``, ``catalog.repairs``,
``catalog.claims``, ``catalog.replicas``), which run inside that transaction:

- ``runs``: create, ensure, update, get and list runs.
- ``attempts``: register an attempt, decide its resume point, read the current one, list them.
- ``saving``: the save path (``begin_checkpoint``, ``mark_committed``, ``mark_failed``).
- ``checkpoints``: queries of checkpoint rows (latest, after a step, by state, one step).
- ``pins``: pin and unpin a checkpoint.
- ``sync``: repairs from storage (``upsert_committed``, ``mark_missing``/``corrupt``/``stale``).
- ``deletion``: retention plans and the claim protocol of gc.
- ``events``: the audit log (record, list, prune).
- ``replicas``: save timings and checkpoint replicas per storage tier.
- ``overview``: batch reads for dashboards (a page of runs, the saves of several runs).
"""
