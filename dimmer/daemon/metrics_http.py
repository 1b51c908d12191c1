"""The Prometheus endpoint's HTTP server: prometheus-client's WSGI app on a thread-per-connection server whose threads
are bounded (issue 12, item 11).

prometheus-client's `start_http_server` starts a thread for every connection, with no limit and no timeout: a client
that opens connections and sends nothing holds a thread (and a socket) each, for ever. Here:

- at most `limits.max_connections` connections are open at once; a new one over the cap closes the longest-silent
  one of the client address holding the most (`netguard.ConnectionTable`), whose thread then ends: a scanner
  holding sockets loses its own, a scraper from another address is served;
- a connection that does not send its request within `limits.idle_timeout_s`, or does not take the response, is
  closed (the handler's socket timeout), so every thread ends within the timeout;
- a failure to listen is a `ListenError` naming host:port and why.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import _SilentHandler

from dimmer.daemon.netguard import ConnectionLimits, ConnectionTable, listen_error

log = logging.getLogger("dimmer.metrics")

METRICS_MAX_CONNECTIONS = 8  # scrapers are few: Prometheus itself, a curl now and then
METRICS_IDLE_TIMEOUT_S = 10.0  # a scrape sends its request at once and reads the answer in milliseconds
VICTIM_JOIN_S = 1.0  # a connection closed at the cap ends at once (its socket was shut down); never wait longer


class BoundedWSGIServer(ThreadingMixIn, WSGIServer):
    """A WSGI server with a thread per connection, at most `limits.max_connections` of them."""

    daemon_threads = True  # as prometheus-client's: a stuck scrape never holds up the daemon's exit

    def __init__(self, address: tuple[str, int], limits: ConnectionLimits) -> None:
        self.limits = limits
        self.table: ConnectionTable[socket.socket] = ConnectionTable(limits)
        self._lock = threading.Lock()
        self._connection_threads: dict[socket.socket, threading.Thread] = {}

        class Handler(_SilentHandler):
            timeout = limits.idle_timeout_s  # StreamRequestHandler: the socket's timeout, reads and writes

        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        host = str(client_address[0]) if isinstance(client_address, tuple) else ""
        with self._lock:
            victims = self.table.add(request, host, time.monotonic())
        for victim in victims:
            # its thread is blocked reading or writing: a shutdown wakes it with end-of-file and it ends
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)
        for victim in victims:
            # wait for it, so that the threads alive never outnumber the cap, not even for the moment one takes to end
            with self._lock:
                thread = self._connection_threads.get(victim)
            if thread is not None and thread is not threading.current_thread():
                thread.join(VICTIM_JOIN_S)
        if request in victims:
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name="dimmer-metrics connection (process_request_thread)",
        )
        thread.daemon = self.daemon_threads
        with self._lock:
            self._connection_threads[request] = thread
        thread.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that hung up, timed out or was closed at the cap: socketserver would print a traceback on stderr
        log.debug("metrics connection from %s ended with an error", client_address, exc_info=True)

    def close_request(self, request: Any) -> None:
        with self._lock:
            self.table.remove(request)
            self._connection_threads.pop(request, None)
        super().close_request(request)


def serve_metrics(
    address: tuple[str, int], registry: CollectorRegistry, limits: ConnectionLimits
) -> tuple[BoundedWSGIServer, threading.Thread]:
    """Serve `registry` on http://host:port/metrics in a daemon thread; ListenError if it cannot listen."""
    host, port = address
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]

        class Server(BoundedWSGIServer):
            address_family = family

        httpd = Server((str(sockaddr[0]), port), limits)
    except (OSError, OverflowError, ValueError) as exc:
        raise listen_error(host, port, exc) from None
    httpd.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=httpd.serve_forever, name="dimmer-metrics", daemon=True)
    thread.start()
    return httpd, thread
