"""The HTTP API front: what SGLang's PD routers (smg, sglang-router) send a prefill server.

``server.HttpApi`` serves it (aiohttp on uvloop, its own thread) beside the ZMQ ingress and
puts each prompt into the same engine inbox. ``bodies`` reads the request JSON, ``prompts``
makes engine requests of it (tokenizing text with ``text``'s codec), ``answers`` shapes the
replies and picks the status the router acts on, ``probes`` answers the router's start-up and
load probes. docs/sglang.md says how to deploy it.
"""

from prefill_worker.ingress.http.probes import ServedModel
from prefill_worker.ingress.http.prompts import is_front_id
from prefill_worker.ingress.http.server import HttpApi
from prefill_worker.ingress.http.text import TextCodec, load_text_codec

__all__ = ["HttpApi", "ServedModel", "TextCodec", "is_front_id", "load_text_codec"]
