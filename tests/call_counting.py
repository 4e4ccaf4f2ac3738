"""Counting the calls of a module's function in a test, where transformers also looks it up in a mapping."""


def count_calls(calls: dict, monkeypatch, module, name: str, mapping: dict | None = None) -> None:
    """Count the calls of `module.name` in `calls[name]` (and of its entries in `mapping`, where transformers looks it
    up)."""
    calls[name] = 0
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    for key, value in list((mapping or {}).items()):
        if value is original:
            monkeypatch.setitem(mapping, key, counted)
