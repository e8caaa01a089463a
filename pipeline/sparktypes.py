"""Spark types derived from pydantic models: a wire format read by Spark is declared
once, as the model its writer uses (sync/gatewaystatus.py), not again as a schema.

Every field is nullable, as Spark's JSON reader needs (a field a message left out
reads as null). str, int, float and bool become string, long, double and boolean;
a Literal the type of its values; ``X | None`` and ``Annotated[X, ...]`` X; a
list an array; a ``dict[str, X]`` a map; a model a struct of its fields, in their
order.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

_PLAIN: dict[Any, DataType] = {
    str: StringType(),
    int: LongType(),
    float: DoubleType(),
    bool: BooleanType(),
}


def struct_of(model: type[BaseModel]) -> StructType:
    """A model's fields as a struct, in their order, each by its name on the wire."""
    return StructType(
        [
            StructField(f.alias or name, spark_type(f.annotation))
            for name, f in model.model_fields.items()
        ]
    )


def spark_type(annotation: Any) -> DataType:
    """The Spark type of a field's annotation (see the module docstring)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return struct_of(annotation)
    if annotation in _PLAIN:
        return _PLAIN[annotation]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is typing.Annotated:
        return spark_type(args[0])
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1:
            raise TypeError(f"{annotation}: a Literal of values of one type")
        return _PLAIN[kinds.pop()]
    if origin in (Union, types.UnionType):
        present = [a for a in args if _bare(a) is not type(None)]
        if len(present) != 1:
            raise TypeError(f"{annotation}: a union other than X | None has no Spark type")
        return spark_type(present[0])
    if origin is list:
        return ArrayType(spark_type(args[0]))
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"{annotation}: map keys must be str")
        return MapType(StringType(), spark_type(args[1]))
    raise TypeError(f"{annotation}: no Spark type for it")


def _bare(annotation: Any) -> Any:
    """``Annotated[X, ...]`` as X (``SkipJsonSchema[None]`` is an annotated None)."""
    while get_origin(annotation) is typing.Annotated:
        annotation = get_args(annotation)[0]
    return annotation
