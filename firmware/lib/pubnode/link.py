# The node's MQTT link to the gateway's ingress, on umqtt.simple.
#
# umqtt.simple publishes at QoS 0 or 1 only and keeps no state, which suits
# the node: a message is retried with the same (boot, seq) until a PUBACK
# arrives, over as many connections as it takes, and the gateway stores a
# repeated (node, boot, seq) once. What umqtt leaves to its caller is here:
# - a read timeout on every publish (umqtt blocks forever otherwise);
# - packet ids wrapped before 65535 (umqtt 1.3.4 would overflow "!H");
# - keepalive pings (umqtt has no timer) and noticing a silent gateway;
# - reconnecting with jittered exponential backoff;
# - one TCP write per packet: umqtt writes a PUBLISH in four pieces, and with
#   Nagle's algorithm against the peer's delayed ACK each message then waits
#   about 40 ms (measured: 45 readings/s instead of thousands over loopback).
#   Fewer, fuller segments also keep the radio on for less time.
# - TLS verified against one pinned certificate (gateway.ca in config.json):
#   never CERT_NONE, which on mbedTLS ports checks nothing at all; CONNECT in
#   one write there too (see Client).
# - software offers (update.py): the node subscribes to nodes/<id>/update at
#   each connect, asks on nodes/<id>/update/req (QoS 0) and takes the answers
#   as they come, in poll() or while a publish waits for its PUBACK; a
#   gateway that refuses the subscription (one without node updates) is sent
#   no requests.
import gc
import time

from umqtt.simple import MQTTClient, MQTTException

from .rand import bits

LINK_ERRORS = (OSError, MQTTException, AssertionError, IndexError)
BACKOFF_MIN_MS = 500
BACKOFF_MAX_MS = 30000
CERT_VERIFY_FAILED = -0x2700  # MBEDTLS_ERR_X509_CERT_VERIFY_FAILED, what MicroPython raises


def cert_refused(err):
    """True when a connect failed because the gateway's certificate was not trusted."""
    if not isinstance(err, OSError):
        return False
    return (err.args and err.args[0] == CERT_VERIFY_FAILED) or "CERT_VERIFY" in str(err)


class PinnedTls:
    """TLS that trusts one certificate (DER) and checks the server's name against it."""

    def __init__(self, cadata, server_hostname):
        self.cadata = cadata
        self.server_hostname = server_hostname

    def wrap_socket(self, sock):
        try:
            import tls  # MicroPython 1.22 and later
        except ImportError:
            import ussl  # before 1.22 (not run by the tests)

            return ussl.wrap_socket(
                sock, cert_reqs=ussl.CERT_REQUIRED, cadata=self.cadata,
                server_hostname=self.server_hostname,
            )  # fmt: skip
        ctx = tls.SSLContext(tls.PROTOCOL_TLS_CLIENT)
        ctx.verify_mode = tls.CERT_REQUIRED
        ctx.load_verify_locations(self.cadata)
        return ctx.wrap_socket(sock, server_hostname=self.server_hostname)


def _jitter(ms):
    return ms // 2 + bits(16) * (ms // 2) // 65536


class Coalesce:
    """The socket umqtt sees: writes gather in a buffer that goes out whole before a read.

    With ``tls`` (a PinnedTls), connect() wraps the socket in TLS once TCP is up.
    ``timeout`` bounds the TCP connect, the TLS handshake and the wait for CONNACK
    (umqtt sets none: a gateway that accepts and then says nothing would hold the
    node until the watchdog reset it).
    """

    def __init__(self, sock, tls=None, timeout=None):
        self.sock = sock
        self.tls = tls
        self.timeout = timeout
        self.buf = bytearray()
        self.rx = 0  # reads that returned bytes: anything from the gateway shows it is there
        if timeout is not None:
            sock.settimeout(timeout)

    def connect(self, addr):
        self.sock.connect(addr)
        if self.tls is not None:
            self.sock = self.tls.wrap_socket(self.sock)

    def write(self, data, n=None):
        if isinstance(data, str):
            data = data.encode()
        self.buf.extend(data if n is None else memoryview(data)[:n])
        return len(data) if n is None else n

    def flush(self):
        if self.buf:
            data, self.buf = self.buf, bytearray()
            view, sent = memoryview(data), 0
            while sent < len(data):
                sent += self.sock.write(view[sent:]) or 0

    def read(self, n):
        self.flush()
        data = self.sock.read(n)
        if data:
            self.rx += 1
        return data

    def settimeout(self, t):
        self.sock.settimeout(t)

    def setblocking(self, flag):
        # umqtt's wait_msg makes the socket blocking once a packet's first byte is in:
        # keep the timeout instead, so a gateway that stops mid-packet cannot hold the node.
        if flag and self.timeout is not None:
            self.sock.settimeout(self.timeout)
        else:
            self.sock.setblocking(flag)

    def close(self):
        self.buf = bytearray()
        self.sock.close()


class Client(MQTTClient):
    """umqtt's client with every socket it makes put behind Coalesce.

    umqtt's connect() makes its socket and writes CONNECT in five pieces; with
    Nagle's algorithm and the gateway's delayed ACK the pieces after the first
    waited about 40 ms for a TLS connect (measured: bench/node_tls.py). Through
    Coalesce CONNECT leaves in one write, and TLS is set up here rather than by
    umqtt, whose TLS arguments differ between versions (1.3: ssl_params for
    ussl.wrap_socket; 1.4 and later: an SSLContext).
    """

    tls = None
    timeout = None
    _sock = None

    @property
    def sock(self):
        return self._sock

    @sock.setter
    def sock(self, s):
        if s is not None and not isinstance(s, Coalesce):
            s = Coalesce(s, self.tls, self.timeout)
        self._sock = s


INBOX = 2  # update messages kept until the loop takes them (one is asked for at a time)


class Link:
    def __init__(
        self, node_id, password, host, port, keepalive_s=60, timeout_s=10, tls=None, updates=False
    ):
        self.node_id = node_id
        self.tls = tls  # a PinnedTls, or None for plaintext
        self.password = password
        self.host, self.port = host, port
        self.keepalive_s = keepalive_s
        self.timeout_s = timeout_s
        self.topic = ("nodes/%s/readings" % node_id).encode()
        self.update_topic = ("nodes/%s/update" % node_id).encode()
        self.request_topic = ("nodes/%s/update/req" % node_id).encode()
        self.updates = updates  # subscribe to software offers at each connect
        self.subscribed = False  # the gateway took the subscription on this connection
        self.inbox = []
        self.dropped = 0  # update messages that came faster than the loop took them
        self.client = None
        self.backoff_ms = BACKOFF_MIN_MS
        self.next_try = time.ticks_ms()
        self.last_tx = self.next_try
        self.ping_sent = None
        self.ping_rx = 0
        self.connects = 0
        self.failures = 0
        self.last_error = None
        self.cert_refused = False  # the last connect failed on the gateway's certificate
        self.connect_ms = -1  # the last successful connect: TCP, TLS handshake, CONNACK
        self.connect_heap = -1  # heap taken by the connection (gc.mem_free drop), -1 unknown

    @property
    def up(self):
        return self.client is not None

    def _fail(self, err):
        self.failures += 1
        self.last_error = repr(err)
        self.close()
        self.next_try = time.ticks_add(time.ticks_ms(), _jitter(self.backoff_ms))
        self.backoff_ms = min(self.backoff_ms * 2, BACKOFF_MAX_MS)

    def close(self):
        c, self.client, self.ping_sent = self.client, None, None
        self.subscribed = False
        if c is not None and c.sock is not None:
            try:
                c.sock.close()
            except OSError:
                pass

    def ensure(self):
        """Connected, or trying again once the backoff allows: True when up."""
        if self.client is not None:
            return True
        if time.ticks_diff(time.ticks_ms(), self.next_try) < 0:
            return False
        c = self._client()
        free0 = gc.mem_free()
        t0 = time.ticks_ms()
        try:
            c.connect()
            c.sock.settimeout(self.timeout_s)
        except LINK_ERRORS as e:
            self.client = c
            self._fail(e)
            self.cert_refused = cert_refused(e)
            return False
        self.connect_ms = time.ticks_diff(time.ticks_ms(), t0)
        free1 = gc.mem_free()
        self.connect_heap = free0 - free1 if free0 >= 0 and free1 >= 0 else -1
        self.cert_refused = False
        self.client = c
        if self.updates:
            try:
                c.subscribe(self.update_topic)
                self.subscribed = True
            except MQTTException:
                self.subscribed = False  # a gateway without node updates: nothing to ask
            except LINK_ERRORS as e:
                self._fail(e)
                return False
        self.connects += 1
        self.backoff_ms = BACKOFF_MIN_MS
        self.last_tx = time.ticks_ms()
        return True

    def _client(self):
        c = Client(
            self.node_id,
            self.host,
            self.port,
            user=self.node_id,
            password=self.password,
            keepalive=self.keepalive_s,
        )
        c.tls = self.tls
        c.timeout = self.timeout_s
        c.set_callback(self._on_msg)
        return c

    def _on_msg(self, topic, msg):
        if topic != self.update_topic:
            return
        if len(self.inbox) >= INBOX:
            self.inbox.pop(0)
            self.dropped += 1
        self.inbox.append(msg)

    def take(self):
        """The update messages received since the last call."""
        got, self.inbox = self.inbox, []
        return got

    def request(self, payload):
        """Ask the gateway something about software (QoS 0: the answer is the ack)."""
        c = self.client
        if c is None:
            return False
        try:
            c.sock.settimeout(self.timeout_s)
            c.publish(self.request_topic, payload, qos=0)
            c.sock.flush()
        except LINK_ERRORS as e:
            self._fail(e)
            return False
        self.last_tx = time.ticks_ms()
        return True

    def poll(self):
        """Take what the gateway sent without waiting: answers, PINGRESP."""
        c = self.client
        if c is None:
            return
        try:
            for _ in range(INBOX):
                rx = c.sock.rx
                op = c.check_msg()  # umqtt: None for a PUBLISH (to _on_msg) or a PINGRESP
                if op is not None:
                    raise OSError("unexpected packet 0x%02x" % op)
                if c.sock.rx == rx:
                    break
        except LINK_ERRORS as e:
            self._fail(e)

    def send(self, payload):
        """Publish at QoS 1 and wait for the PUBACK: True when it came."""
        c = self.client
        if c is None:
            return False
        if c.pid >= 65535:
            c.pid = 0
        try:
            c.sock.settimeout(self.timeout_s)  # umqtt's check_msg leaves it blocking
            c.publish(self.topic, payload, qos=1)
        except LINK_ERRORS as e:
            self._fail(e)
            return False
        self.last_tx = time.ticks_ms()
        self.ping_sent = None
        return True

    def keepalive(self):
        """Ping when idle for half the keepalive; drop a gateway that stopped answering."""
        c = self.client
        if c is None:
            return
        now = time.ticks_ms()
        try:
            if self.ping_sent is not None:
                self.poll()
                if self.client is None:
                    return
                if c.sock.rx != self.ping_rx:
                    self.ping_sent = None  # the PINGRESP, or anything else: it is there
                elif time.ticks_diff(now, self.ping_sent) > self.timeout_s * 1000:
                    raise OSError("no PINGRESP in %d s" % self.timeout_s)
            elif time.ticks_diff(now, self.last_tx) > self.keepalive_s * 500:
                c.ping()
                c.sock.flush()
                self.ping_sent = self.last_tx = now
                self.ping_rx = c.sock.rx
        except LINK_ERRORS as e:
            self._fail(e)
