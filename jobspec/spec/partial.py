"""The rules pydantic skips, run on the part of a spec that validated: every problem in one pass.

Pydantic runs a model's own validators (`JobSpec._check`, `TrainingSpec._schedule`, a field's
`@field_validator`) only once every field under them is valid. A spec with `learning_rate: -1`
would then hide its unknown GPU type and its indivisible global batch until the next run. Here
each model that failed is read again field by field: a field that validates on its own keeps its
value, a section that does not is read the same way one level down, and the skipped validators
run on that view. A rule that reads a field which did not validate meets `Unreadable` and is
skipped (`jobspec.spec.rules`): that field's own problem is already reported.

The result is pydantic's error shape, so the loader words, locates and scrubs these problems as
it does pydantic's. Only a spec that failed pays for this.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PydanticUserError, TypeAdapter, ValidationError

from jobspec.spec.models import JobSpec, annotation_types
from jobspec.spec.rules import Unreadable

Loc = tuple[str | int, ...]


def skipped_problems(data: Any) -> list[dict[str, Any]]:
    """Pydantic-shaped errors (loc, msg, type, ctx) of the validators pydantic skipped on `data`."""
    errors: list[dict[str, Any]] = []
    if isinstance(data, dict):
        _view(JobSpec, data, (), errors)
    return errors


class _View:
    """A model that did not validate, read field by field: a field that failed raises `Unreadable`.

    The model's properties (`world_size`, `memory_bytes`) and `model_dump` work on the view, so the
    model's own validators run on it unchanged.
    """

    __slots__ = ("_given", "_loc", "_model", "_values")

    def __init__(self, model: type[BaseModel], values: dict[str, Any], loc: Loc, given: set[str] | None = None) -> None:
        self._model, self._values, self._loc = model, values, loc
        self._given = given if given is not None else set(values)  # what the spec set: `model_fields_set`

    def __getattr__(self, name: str) -> Any:  # only for what is not a slot
        if name in self._values:
            return self._values[name]
        if name == "__pydantic_fields_set__":  # behind BaseModel.model_fields_set, which validators read
            return self._given
        if name in self._model.model_fields:
            raise Unreadable(".".join(map(str, (*self._loc, name))))
        attribute = getattr(self._model, name, None)
        if isinstance(attribute, property) and attribute.fget is not None:
            return attribute.fget(self)
        raise AttributeError(f"{self._model.__name__} view has no {name!r}")

    def model_dump(self, *, exclude: set[str] | None = None) -> dict[str, Any]:
        """What validated, dumped as the model would dump it; the fields that did not are left out."""
        return {
            name: value.model_dump() if isinstance(value, _View) else _adapter(self._model, name).dump_python(value)
            for name, value in self._values.items()
            if not exclude or name not in exclude
        }


def _view(model: type[BaseModel], raw: dict[str, Any], loc: Loc, errors: list[dict[str, Any]]) -> _View:
    values: dict[str, Any] = {}
    # Every field validated and no unknown key beside them (extra="forbid"): pydantic ran this model's validators.
    complete = set(raw) <= set(model.model_fields)
    for name, field in model.model_fields.items():
        if name not in raw:
            if field.is_required():
                complete = False
            else:
                values[name] = field.get_default(call_default_factory=True)
            continue
        try:
            values[name] = _validate_field(model, name, raw[name])
            continue
        except ValueError:  # pydantic's ValidationError is one
            complete = False
        inner = _section(model, name, raw[name])
        if inner is not None:
            values[name] = _view(inner[0], inner[1], (*loc, name), errors)
        else:
            _field_validators_on_valid_items(model, name, raw[name], (*loc, name), errors)
    given = set(raw) & set(model.model_fields)
    if not complete:
        for decorator in model.__pydantic_decorators__.model_validators.values():
            if decorator.info.mode == "after":
                _run(lambda func=decorator.func: func(_View(model, values, loc, given)), loc, raw, errors)
    return _View(model, values, loc, given)


def _run(check: Callable[[], Any], loc: Loc, value: Any, errors: list[dict[str, Any]]) -> None:
    """Run one skipped validator; its ValueError becomes an error at `loc`, as pydantic would report it."""
    try:
        check()
    except Unreadable:
        pass
    except (AttributeError, TypeError, LookupError, ArithmeticError):
        # A rule that cannot run on a partial view (it reads what the view does not model): skipped, as one that
        # reads an unreadable field is. The spec has failed already; its field problems are what gets reported.
        pass
    except ValueError as err:  # CrossFieldError and HintedValueError included: the loader reads ctx.error
        errors.append(
            {"type": "value_error", "loc": loc, "msg": f"Value error, {err}", "input": value, "ctx": {"error": err}}
        )


def _validate_field(model: type[BaseModel], name: str, value: Any) -> Any:
    """`value` validated as `model.name` alone: the field's type and constraints, then its field validators."""
    validators = _field_validators(model, name)
    if validators is None:
        raise ValueError(f"{model.__name__}.{name} is not validated apart from its model")
    validated = _adapter(model, name).validate_python(value)
    for decorator in validators:
        validated = decorator.func(validated)
    return validated


def _field_validators(model: type[BaseModel], name: str) -> list[Any] | None:
    """The field's @field_validators (classmethods), or None where one is not an after-validator: those are
    not replayed (none in the spec today), and the field then counts as one that did not validate."""
    found = [d for d in model.__pydantic_decorators__.field_validators.values() if name in d.info.fields]
    return None if any(d.info.mode != "after" for d in found) else found


def _field_validators_on_valid_items(
    model: type[BaseModel], name: str, raw: Any, loc: Loc, errors: list[dict[str, Any]]
) -> None:
    """A map field with a bad item (`env: {A: [1], HF_TOKEN: hf_...}`): its validators run on the good items."""
    validators = _field_validators(model, name) if isinstance(raw, dict) else None
    items = _item_adapter(model, name) if validators else None
    if items is None:
        return
    good: dict[Any, Any] = {}
    for key, item in raw.items():
        try:
            good |= items.validate_python({key: item})  # the key too: `1: x` is no variable name
        except ValidationError:
            continue
    if len(good) == len(raw):
        return  # the map failed on its validators themselves: pydantic reported that
    for decorator in validators:
        _run(lambda func=decorator.func: func(good), loc, raw, errors)


def _section(model: type[BaseModel], name: str, raw: Any) -> tuple[type[BaseModel], dict[str, Any]] | None:
    """(the model inside field `name`, `raw` as its before-validators hand it on), when `raw` is a mapping."""
    field = model.model_fields[name]
    for meta in field.metadata:
        if isinstance(meta, BeforeValidator):
            try:
                raw = meta.func(raw)  # type: ignore[call-arg]
            except (ValueError, TypeError):
                return None
    inner = [a for a in annotation_types(field.annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return (inner[0], raw) if len(inner) == 1 and isinstance(raw, dict) else None


_CONFIG = ConfigDict(allow_inf_nan=False)  # the sections' own setting, for a field that is not a model


@functools.cache
def _adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    field = model.model_fields[name]
    annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    try:
        return TypeAdapter(annotation, config=_CONFIG if model.model_config.get("allow_inf_nan") is False else None)
    except PydanticUserError:  # a model brings its own config
        return TypeAdapter(annotation)


@functools.cache
def _item_adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any] | None:
    annotation = model.model_fields[name].annotation
    return TypeAdapter(annotation, config=_CONFIG) if typing.get_origin(annotation) is dict else None
