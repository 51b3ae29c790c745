"""A request body's output constraint -> StructuredOutputsParams, validated (400 naming the field).

Where a constraint can come from, all equivalent, at most one per request:
  - OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
    "schema", "strict", "description"}}; vLLM's {"type": "structural_tag"} is recognised and refused;
  - vLLM: `structured_outputs` {json, regex, choice, grammar, json_object, and its options};
  - vLLM's older names: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, with
    `guided_whitespace_pattern` and `guided_decoding_backend` (only llguidance here: "auto", "guidance"
    and "llguidance" are accepted, any other backend is a 400 rather than silently ours).
Parsing reads the fields only (Python, on the event loop): the constraint is compiled by the engine's grammar
workers (octavo/structured/compiler.py), which the route awaits before the request is queued, so a malformed or
oversized schema / regex / grammar is still a 400 naming its field before anything runs.
"""
from __future__ import annotations

from typing import Any

from octavo.serving.api_error import bad_request
from octavo.structured.params import StructuredOutputError, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
GUIDED_OPTIONS = ("guided_whitespace_pattern", "guided_decoding_backend")
OUR_BACKENDS = ("auto", "guidance", "llguidance")
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED, *GUIDED_OPTIONS)


def parse_constraint(d: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The body's constraint and the request field it came from (None, None: unconstrained)."""
    sources: list[tuple[StructuredOutputsParams, str]] = []
    rf = _response_format(d.get("response_format"))
    if rf is not None:
        sources.append((rf, "response_format"))
    so = d.get("structured_outputs")
    if so is not None:
        try:
            sources.append((StructuredOutputsParams.from_dict(so), "structured_outputs"))
        except StructuredOutputError as exc:
            raise bad_request(f"'structured_outputs.{exc.field}': {exc}", "structured_outputs") from None
    guided = [(name, d[name]) for name in GUIDED if d.get(name) is not None]
    backend = d.get("guided_decoding_backend")
    if backend is not None and (not isinstance(backend, str) or backend.split(":")[0] not in OUR_BACKENDS):
        raise bad_request(f"'guided_decoding_backend' {backend!r} is not available: this server's structured "
                          f"outputs use llguidance ({', '.join(OUR_BACKENDS)})", "guided_decoding_backend")
    ws = d.get("guided_whitespace_pattern")
    if len(guided) > 1:
        raise bad_request(f"only one guided_* constraint per request, got {', '.join(n for n, _ in guided)}",
                          guided[1][0])
    if guided:
        name, value = guided[0]
        try:
            sources.append((StructuredOutputsParams(**{GUIDED[name]: value}, whitespace_pattern=ws), name))
        except StructuredOutputError as exc:
            raise bad_request(f"'{name}': {exc}", name) from None
    elif ws is not None:
        raise bad_request("'guided_whitespace_pattern' needs 'guided_json'", "guided_whitespace_pattern")
    if len(sources) > 1:
        raise bad_request(f"one output constraint per request, got {' and '.join(f for _, f in sources)}",
                          sources[1][1])
    if not sources:
        return None, None
    return sources[0]


def _response_format(rf: Any) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type' (text, json_object, json_schema)",
                          "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("'response_format.json_schema' must be an object with 'name' and 'schema'",
                              "response_format")
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise bad_request("'response_format.json_schema.name' must be a string", "response_format")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise bad_request("'response_format.json_schema.strict' must be a boolean", "response_format")
        schema = js.get("schema", js.get("json_schema"))  # vLLM also reads the field as json_schema
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                              "response_format")
        try:
            return StructuredOutputsParams(json=schema)
        except StructuredOutputError as exc:
            raise bad_request(f"'response_format.json_schema.schema': {exc}", "response_format") from None
    if kind == "structural_tag":
        raise bad_request("response_format type 'structural_tag' is not supported by this server; use "
                          "json_schema", "response_format")
    raise bad_request(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                      "response_format")


def from_request_parameters(parameters: str | dict[str, Any] | None,
                            ) -> tuple[StructuredOutputsParams, str] | tuple[None, None]:
    """The constraint of a Triton request and the parameter it came from: its request parameters (`parameters`
    of a tritonclient infer, the extra fields of a generate body) under the same names as the HTTP fields.
    Triton parameters are scalars, so objects and lists come as JSON text. InvalidRequestError if malformed
    (the constraint itself is compiled when the request is submitted: name the parameter in its error)."""
    from octavo.errors import InvalidRequestError
    from octavo.serving.api_error import ApiError

    import json

    if not parameters:
        return None, None
    try:
        d = json.loads(parameters) if isinstance(parameters, str) else dict(parameters)
    except ValueError as exc:
        raise InvalidRequestError(f"request parameters are not JSON: {exc}") from None
    picked: dict[str, Any] = {}
    for name in CONSTRAINT_FIELDS:
        v = d.get(name)
        if isinstance(v, str) and name in ("response_format", "structured_outputs", "guided_choice"):
            try:
                v = json.loads(v)
            except ValueError:
                raise InvalidRequestError(f"request parameter {name} must be JSON text, got {v[:40]!r}") from None
        if v is not None:
            picked[name] = v
    try:
        return parse_constraint(picked)
    except ApiError as exc:
        raise InvalidRequestError(f"request parameter {exc.message}") from None
