"""``zephon ui``: a read-only dashboard over the catalog (docs/ui.md).

``views`` reads what each page shows from a ``Catalog`` opened read-only; ``app`` serves it
(Starlette, GET only); ``access`` keeps it on loopback unless asked, behind a token then;
``server`` binds the port and runs uvicorn. Needs the ``ui`` extra
(``pip install 'zephon[ui]'``); nothing here is imported by ``import zephon``.
"""
