"""The one Schemathesis check the contract test narrows (tests/test_openapi_contract.py; also
usable as a CLI hook: ``SCHEMATHESIS_HOOKS=contract_checks`` with ``tests/`` on PYTHONPATH).

``positive_data_acceptance`` wants every schema-valid request accepted, but some rules are not
expressible in a schema shared by every operator (the variables and families of *this*
operator, equal column lengths, a recipient of *this* factor, a belief the factor can produce).
Such a request may be refused only with a 422 whose every item is one of the server's own,
documented semantic types (:data:`SEMANTIC_422`) — a 422 from the body's parser (a type, bound
or format the schema failed to state) still fails.  And "schema-valid" is checked, not assumed:
Schemathesis' coverage phase labels some bodies positive that its own schema rejects (an
``"0"`` where a oneOf of objects is required); such a case is judged as the negative case it is.
"""

from __future__ import annotations

import json

import jsonschema
import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

#: 422 types the server raises for rules a schema shared by every operator cannot state
SEMANTIC_422 = {"unknown_variable", "missing", "wrong_family", "length_mismatch", "too_long", "unknown_recipient",
                "wrong_recipient", "not_computable", "oracle_failed", "implausible_belief", "not_learnable", "no_server_oracle",
                "too_short", "value_error"}

_validators: dict = {}


def _body_valid(case) -> bool:
    """The case's JSON body validates against its operation's request-body schema."""
    op = case.operation
    spec = op.schema.raw_schema
    body = spec["paths"][op.path][op.method.lower()].get("requestBody")
    if body is None or case.body is None:
        return True
    key = (op.path, op.method)
    v = _validators.get(key)
    if v is None:
        ref = body["content"]["application/json"]["schema"]
        v = _validators[key] = jsonschema.Draft202012Validator({**ref, "components": spec["components"]})
    try:
        json.dumps(case.body, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return v.is_valid(case.body)


@schemathesis.check
def semantic_positive_data_acceptance(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    if not _body_valid(case):
        return None  # mislabelled: the negative-data checks judge it
    if response.status_code == 422:
        unexpected = [i for i in response.json()["detail"] if i["type"] not in SEMANTIC_422]
        if unexpected:
            raise AssertionError(f"schema-valid request refused by the parser: {unexpected}")
        return None
    return positive_data_acceptance(ctx, response, case)
