"""Identifiers and the base model every shared type builds on."""

from typing import NewType
from uuid import uuid4

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

NodeId = NewType("NodeId", str)
ModelId = NewType("ModelId", str)
InstanceId = NewType("InstanceId", str)
RunnerId = NewType("RunnerId", str)
TaskId = NewType("TaskId", str)
CommandId = NewType("CommandId", str)


def new_id() -> str:
    return str(uuid4())


class FrozenModel(BaseModel):
    """Immutable, strict, and camelCase on the wire (the dashboard and upstream exo's
    clients read camelCase), while Python code uses snake_case names."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        serialize_by_alias=True,
    )
