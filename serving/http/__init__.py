"""The HTTP front: the OpenAI-compatible server (``server``: the app and its
routes, over ``protocol``, ``parsing``, ``engine_loop``, ``responses`` and
``metrics``), data-parallel replicas started by ``replica_launch`` behind one
front (``replicas``) and its router (``router``)."""
