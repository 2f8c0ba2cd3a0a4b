"""An app served by uvicorn in a thread of the test process."""

import threading
import time

import uvicorn

from serving.http.server import bind_socket


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0):
  """Runs the ASGI ``app`` under uvicorn in a daemon thread.

  Returns:
    ``(server, thread, port)``: ``server.should_exit = True`` and
    ``thread.join()`` stop it; ``port`` is the bound port (0 picks a free one).
  """
  sock = bind_socket(host, port)
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not server.started:
    if not thread.is_alive() or time.monotonic() > deadline:
      raise RuntimeError("uvicorn did not start")
    time.sleep(0.01)
  return server, thread, sock.getsockname()[1]
