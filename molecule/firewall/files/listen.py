"""Throw-away listeners on the ports where no real service of this scenario runs: TCP ports accept and close,
UDP ports answer every datagram. Ports already taken (sshd) are left to their owner."""
import selectors
import socket
import sys

selector = selectors.DefaultSelector()
for spec in sys.argv[1:]:
    port, protocol = spec.split("/")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("0.0.0.0", int(port)))
    except OSError:
        continue
    if protocol == "tcp":
        sock.listen(64)
    selector.register(sock, selectors.EVENT_READ, protocol)
print("listening", flush=True)
while True:
    for key, _ in selector.select():
        if key.data == "tcp":
            connection, _ = key.fileobj.accept()
            connection.close()
        else:
            data, peer = key.fileobj.recvfrom(64)
            key.fileobj.sendto(data, peer)
