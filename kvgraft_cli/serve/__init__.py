"""`kvgraft serve`: the library behind an OpenAI-compatible HTTP endpoint.

``protocol`` parses and checks request bodies (no torch); ``promptcache`` keeps prompt prefixes as chunk chains in
the store; ``answer`` computes one request on the engine and writes its ledger line; ``worker`` runs requests one at
a time on the engine's thread behind a bounded queue; ``app`` is the ASGI app (Starlette, the ``serve`` extra).
"""
