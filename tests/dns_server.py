"""A name server the tests control: answers A queries for the names it is given (UDP on 127.0.0.1)."""

from __future__ import annotations

import socket
import threading

import dns.message
import dns.rdatatype
import dns.rrset


class NameServer:
    """`records`: name -> IPv4 addresses (mutable: a test may change them while it runs)."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, name="dns", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return  # closed
            query = dns.message.from_wire(data)
            response = dns.message.make_response(query)
            for question in query.question:
                name = question.name.to_text().rstrip(".")
                if question.rdtype == dns.rdatatype.A and self.records.get(name):
                    response.answer.append(dns.rrset.from_text(question.name, 1, "IN", "A", *self.records[name]))
            self.sock.sendto(response.to_wire(), peer)

    def close(self) -> None:
        self.sock.close()
