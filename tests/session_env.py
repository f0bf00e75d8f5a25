"""The environment of the test session, set once when conftest imports this module.

Authentication is on in every server the tests start, as it is by default: one test token, known to the
servers through COALESCE_AUTH__TOKENS and sent by the clients through COALESCE_TOKEN (both inherited by the
processes tests spawn); raw gRPC stubs send `AUTH`. XDG_CONFIG_HOME points at a temporary folder, so no
test reads or writes the user's own local token (~/.config/coalesce/local-token).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

TOKEN = "coalesce-test-token"
TENANT = "test"
AUTH = ("authorization", f"Bearer {TOKEN}")

os.environ["COALESCE_TOKEN"] = TOKEN
os.environ["COALESCE_AUTH__TOKENS"] = json.dumps({hashlib.sha256(TOKEN.encode()).hexdigest(): TENANT})
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="coalesce-test-config-")
