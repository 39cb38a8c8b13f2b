"""Starting and supervising the mesh: ``tidal serve`` (``serve``), ``tidal run ROLE`` (``run``), the one
supervisor both use (``supervisor``), each role's entry point (``roles``), typed sockets (``ipc``) and
fault injection for the tests (``faults``)."""
