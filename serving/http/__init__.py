"""The HTTP front: the OpenAI-compatible server (``server``), data-parallel
replicas behind one front (``replicas``) and its router (``router``)."""
