"""Every shared contract of servefleet, one module each (see this room's README).

Deliberately empty: importing one contract (say the CLI's `engine_flags`, before it binds a
port) must not load the others, pydantic and all. Import from the module that defines a name.
"""
