"""Every request field says how it is served, and docs/api.md's table says the same."""
from __future__ import annotations

from pagedserve.server import api_doc
from pagedserve.server.protocol import field_support


def test_every_request_field_has_a_support_mark():
    for _, model in api_doc.ROUTES:
        for name in model.model_fields:
            info = field_support(model, name)
            assert info.get("support") in ("supported", "partial", "rejected"), f"{model.__name__}.{name}"
            if info["support"] != "supported":
                assert info.get("note"), f"{model.__name__}.{name} needs a note saying what is refused"


def test_docs_api_table_is_generated_from_the_models():
    current = api_doc.DOC.read_text()
    assert api_doc.render(current) == current, "docs/api.md is out of date: run python -m pagedserve.server.api_doc"
    assert api_doc.main(["--check"]) == 0
