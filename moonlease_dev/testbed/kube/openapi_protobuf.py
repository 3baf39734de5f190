"""The OpenAPI v2 document as protobuf: gnostic's `openapi.v2.Document`, what client-go asks for.

client-go reads `/openapi/v2` only as protobuf (`Accept: application/com.github.proto-openapi.spec.v2@v1.0+protobuf`,
decoded with gnostic-models' `openapiv2/OpenAPIv2.proto`, no JSON fallback): kubectl's client-side
validation and apply's patch lookup, `kubectl explain --output=plaintext-openapiv2`, and Helm's
manifest validation (`install --dry-run=server`) read it. The API server answers with the
document it serves as JSON, converted field by field (kube-openapi's `ToProtoBinary`); this does
the same for the Swagger 2.0 documents `openapi.openapi_v2` builds. Pure.

The field numbers below are those of OpenAPIv2.proto. Every key of the JSON document has its
field: a key with none raises `NotEncodable` (the document would not be what the JSON says), as
gnostic refuses a document with a property Swagger 2.0 does not allow. Free-form values
(`default`, `example`, `enum` items, `x-*` vendor extensions) travel as gnostic's `Any` with the
value's YAML text, as gnostic writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import yaml

from moonlease_dev.testbed.kube.wire import field_bool, field_bytes, field_double, field_int, field_string

#: The media type client-go asks for, and the one the API server answers with (kube-openapi
#: answers both spellings with the dotted one: `@` is not a token character of a media type).
PROTOBUF_MEDIA_TYPES = ("application/com.github.proto-openapi.spec.v2@v1.0+protobuf",
                        "application/com.github.proto-openapi.spec.v2.v1.0+protobuf")
PROTOBUF_CONTENT_TYPE = PROTOBUF_MEDIA_TYPES[1]
JSON_CONTENT_TYPE = "application/json"


class NotEncodable(ValueError):
    """A document key or value with no place in gnostic's messages."""


#: A message: JSON key -> (field number, kind), and the field number of its `x-*` vendor
#: extensions (repeated NamedAny; None: the message takes none). Kinds: string, bool, int
#: (int64), double, any (gnostic's Any), a message name, and "[]" + either for repeated fields.
Spec = tuple[Mapping[str, tuple[int, str]], int | None]

#: The fields every primitive-typed message (PrimitivesItems, the non-body parameters) declares
#: in this order, numbered one after another from where each message starts them.
_PRIMITIVE_FIELDS = (("type", "string"), ("format", "string"), ("items", "PrimitivesItems"),
                     ("collectionFormat", "string"), ("default", "any"), ("maximum", "double"),
                     ("exclusiveMaximum", "bool"), ("minimum", "double"), ("exclusiveMinimum", "bool"),
                     ("maxLength", "int"), ("minLength", "int"), ("pattern", "string"), ("maxItems", "int"),
                     ("minItems", "int"), ("uniqueItems", "bool"), ("enum", "[]any"), ("multipleOf", "double"))
_PARAMETER_HEAD = {"required": (1, "bool"), "in": (2, "string"), "description": (3, "string"), "name": (4, "string")}


def _primitive_fields(first: int) -> dict[str, tuple[int, str]]:
    return {key: (number, kind) for number, (key, kind) in enumerate(_PRIMITIVE_FIELDS, first)}


MESSAGES: dict[str, Spec] = {
    "Document": ({"swagger": (1, "string"), "info": (2, "Info"), "host": (3, "string"), "basePath": (4, "string"),
                  "schemes": (5, "[]string"), "consumes": (6, "[]string"), "produces": (7, "[]string"),
                  "paths": (8, "Paths"), "definitions": (9, "Definitions"), "tags": (14, "[]Tag"),
                  "externalDocs": (15, "ExternalDocs")}, 16),
    "Info": ({"title": (1, "string"), "version": (2, "string"), "description": (3, "string"),
              "termsOfService": (4, "string"), "contact": (5, "Contact"), "license": (6, "License")}, 7),
    "Contact": ({"name": (1, "string"), "url": (2, "string"), "email": (3, "string")}, 4),
    "License": ({"name": (1, "string"), "url": (2, "string")}, 3),
    "ExternalDocs": ({"description": (1, "string"), "url": (2, "string")}, 3),
    "Tag": ({"name": (1, "string"), "description": (2, "string"), "externalDocs": (3, "ExternalDocs")}, 4),
    "Xml": ({"name": (1, "string"), "namespace": (2, "string"), "prefix": (3, "string"), "attribute": (4, "bool"),
             "wrapped": (5, "bool")}, 6),
    "PathItem": ({"$ref": (1, "string"), "get": (2, "Operation"), "put": (3, "Operation"), "post": (4, "Operation"),
                  "delete": (5, "Operation"), "options": (6, "Operation"), "head": (7, "Operation"),
                  "patch": (8, "Operation"), "parameters": (9, "[]ParametersItem")}, 10),
    "Operation": ({"tags": (1, "[]string"), "summary": (2, "string"), "description": (3, "string"),
                   "externalDocs": (4, "ExternalDocs"), "operationId": (5, "string"), "produces": (6, "[]string"),
                   "consumes": (7, "[]string"), "parameters": (8, "[]ParametersItem"), "responses": (9, "Responses"),
                   "schemes": (10, "[]string"), "deprecated": (11, "bool")}, 13),
    "Response": ({"description": (1, "string"), "schema": (2, "SchemaItem")}, 5),
    "JsonReference": ({"$ref": (1, "string"), "description": (2, "string")}, None),
    "BodyParameter": ({"description": (1, "string"), "name": (2, "string"), "in": (3, "string"),
                       "required": (4, "bool"), "schema": (5, "Schema")}, 6),
    # Query and formData parameters share their numbering; header and path parameters have no
    # allowEmptyValue and number the primitive fields from 5.
    "QueryParameterSubSchema": ({**_PARAMETER_HEAD, "allowEmptyValue": (5, "bool"), **_primitive_fields(6)}, 23),
    "HeaderParameterSubSchema": ({**_PARAMETER_HEAD, **_primitive_fields(5)}, 22),
    "PrimitivesItems": (_primitive_fields(1), 18),
    "Schema": ({
        "$ref": (1, "string"), "format": (2, "string"), "title": (3, "string"), "description": (4, "string"),
        "default": (5, "any"), "multipleOf": (6, "double"), "maximum": (7, "double"), "exclusiveMaximum": (8, "bool"),
        "minimum": (9, "double"), "exclusiveMinimum": (10, "bool"), "maxLength": (11, "int"), "minLength": (12, "int"),
        "pattern": (13, "string"), "maxItems": (14, "int"), "minItems": (15, "int"), "uniqueItems": (16, "bool"),
        "maxProperties": (17, "int"), "minProperties": (18, "int"), "required": (19, "[]string"), "enum": (20, "[]any"),
        "additionalProperties": (21, "AdditionalPropertiesItem"), "type": (22, "TypeItem"), "items": (23, "ItemsItem"),
        "allOf": (24, "[]Schema"), "properties": (25, "Properties"), "discriminator": (26, "string"),
        "readOnly": (27, "bool"), "xml": (28, "Xml"), "externalDocs": (29, "ExternalDocs"), "example": (30, "any")}, 31),
}
MESSAGES["FormDataParameterSubSchema"] = MESSAGES["QueryParameterSubSchema"]
MESSAGES["PathParameterSubSchema"] = MESSAGES["HeaderParameterSubSchema"]

#: Where each non-body parameter goes in `NonBodyParameter`'s oneof, by its `in`.
_NON_BODY = {"header": (1, "HeaderParameterSubSchema"), "formData": (2, "FormDataParameterSubSchema"),
             "query": (3, "QueryParameterSubSchema"), "path": (4, "PathParameterSubSchema")}


def _yaml(value: Any) -> str:
    """A free-form value as gnostic keeps it (`Any.yaml`): its YAML text, without PyYAML's
    end-of-document marker after a lone scalar."""
    text = yaml.safe_dump(value, default_flow_style=False, sort_keys=False, allow_unicode=True)
    return text.removesuffix("...\n")


def _any(value: Any) -> bytes:
    """gnostic's Any: field 2, the YAML (field 1, a google.protobuf.Any, is never used for JSON)."""
    return field_string(2, _yaml(value), always=True)


def _named(name: str, value: bytes) -> bytes:
    """gnostic's Named* pairs: name 1, value 2."""
    return field_string(1, name, always=True) + field_bytes(2, value)


def _vendor_extensions(number: int, extensions: Mapping[str, Any]) -> bytes:
    return b"".join(field_bytes(number, _named(name, _any(value))) for name, value in extensions.items())


#: The JSON types the fields take, by the name errors give them.
_JSON_TYPES: dict[str, tuple[type, ...]] = {"object": (Mapping,), "string": (str,), "number": (int, float),
                                            "integer": (int,), "boolean": (bool,), "list": (list,)}


def _checked(value: Any, expected: str, where: str) -> Any:
    """`value` if it has the JSON type `expected` (a boolean is not a number here), else NotEncodable."""
    if not isinstance(value, _JSON_TYPES[expected]) or (isinstance(value, bool) and expected in ("number", "integer")):
        article = "an" if expected[0] in "aeiou" else "a"
        raise NotEncodable(f"{where}: expected {article} {expected}, got {type(value).__name__}")
    return value


def encode_message(name: str, value: Any, where: str = "") -> bytes:
    """The bytes of message `name` holding the JSON `value`, fields in number order."""
    if name in _SPECIAL:
        return _SPECIAL[name](value, where)
    fields, extension_number = MESSAGES[name]
    obj = _checked(value, "object", where or name)
    parts: list[tuple[int, bytes]] = []
    extensions: dict[str, Any] = {}
    for json_key, item in obj.items():
        path = f"{where}.{json_key}"
        if json_key in fields:
            number, kind = fields[json_key]
            parts.append((number, _field(number, kind, item, path)))
        elif json_key.startswith("x-") and extension_number is not None:
            extensions[json_key] = item
        else:
            raise NotEncodable(f"{path}: {name} has no field {json_key!r} in OpenAPI v2")
    if extensions and extension_number is not None:
        parts.append((extension_number, _vendor_extensions(extension_number, extensions)))
    return b"".join(data for _, data in sorted(parts, key=lambda part: part[0]))


def _field(number: int, kind: str, value: Any, where: str) -> bytes:
    if kind.startswith("[]"):
        return b"".join(_field(number, kind[2:], item, f"{where}[{index}]")
                        for index, item in enumerate(_checked(value, "list", where)))
    match kind:
        case "string":
            return field_string(number, _checked(value, "string", where))
        case "bool":
            return field_bool(number, _checked(value, "boolean", where))
        case "int":
            return field_int(number, _checked(value, "integer", where))
        case "double":
            return field_double(number, float(_checked(value, "number", where)))
        case "any":
            return field_bytes(number, _any(value))
    return field_bytes(number, encode_message(kind, value, where))


def _named_schemas(value: Any, where: str) -> bytes:
    """Properties and Definitions: repeated NamedSchema (field 1), in the document's order."""
    return b"".join(field_bytes(1, _named(name, encode_message("Schema", schema, f"{where}.{name}")))
                    for name, schema in _checked(value, "object", where).items())


def _type_item(value: Any, where: str) -> bytes:
    """TypeItem: repeated string `value` (1); JSON writes one type as a string."""
    types = [value] if isinstance(value, str) else _checked(value, "list", where)
    return b"".join(field_string(1, _checked(item, "string", where), always=True) for item in types)


def _items_item(value: Any, where: str) -> bytes:
    """ItemsItem: repeated Schema (1); JSON writes one schema as an object."""
    schemas = value if isinstance(value, list) else [value]
    return b"".join(field_bytes(1, encode_message("Schema", item, where)) for item in schemas)


def _additional_properties(value: Any, where: str) -> bytes:
    """AdditionalPropertiesItem: oneof schema (1) | boolean (2); `false` is written too."""
    if isinstance(value, bool):
        return field_bool(2, value, always=True)
    return field_bytes(1, encode_message("Schema", value, where))


def _schema_item(value: Any, where: str) -> bytes:
    """SchemaItem: oneof schema (1) | file_schema (2); only schemas are published here."""
    if _checked(value, "object", where).get("type") == "file":
        raise NotEncodable(f"{where}: file schemas are not published by the local API server")
    return field_bytes(1, encode_message("Schema", value, where))


def _parameters_item(value: Any, where: str) -> bytes:
    """ParametersItem: oneof parameter (1) | json_reference (2); a Parameter is oneof
    body_parameter (1) | non_body_parameter (2), the latter oneof by `in`."""
    obj = _checked(value, "object", where)
    if "$ref" in obj:
        return field_bytes(2, encode_message("JsonReference", obj, where))
    place = obj.get("in")
    if place == "body":
        parameter = field_bytes(1, encode_message("BodyParameter", obj, where))
    elif isinstance(place, str) and place in _NON_BODY:
        number, message = _NON_BODY[place]
        parameter = field_bytes(2, field_bytes(number, encode_message(message, obj, where)))
    else:
        raise NotEncodable(f"{where}.in: {place!r} is not a parameter location of OpenAPI v2")
    return field_bytes(1, parameter)


def _paths(value: Any, where: str) -> bytes:
    """Paths: vendor extensions (1), then repeated NamedPathItem (2)."""
    obj = _checked(value, "object", where)
    extensions = {name: item for name, item in obj.items() if name.startswith("x-")}
    return _vendor_extensions(1, extensions) + b"".join(
        field_bytes(2, _named(path, encode_message("PathItem", item, f"{where}.{path}")))
        for path, item in obj.items() if not path.startswith("x-"))


def _responses(value: Any, where: str) -> bytes:
    """Responses: repeated NamedResponseValue (1), then vendor extensions (2); a ResponseValue
    is oneof response (1) | json_reference (2)."""
    obj = _checked(value, "object", where)
    codes = b""
    for code, response in obj.items():
        if code.startswith("x-"):
            continue
        path = f"{where}.{code}"
        if "$ref" in _checked(response, "object", path):
            response_value = field_bytes(2, encode_message("JsonReference", response, path))
        else:
            response_value = field_bytes(1, encode_message("Response", response, path))
        codes += field_bytes(1, _named(code, response_value))
    return codes + _vendor_extensions(2, {name: item for name, item in obj.items() if name.startswith("x-")})


_SPECIAL: dict[str, Callable[[Any, str], bytes]] = {
    "Definitions": _named_schemas, "Properties": _named_schemas, "TypeItem": _type_item, "ItemsItem": _items_item,
    "AdditionalPropertiesItem": _additional_properties, "SchemaItem": _schema_item,
    "ParametersItem": _parameters_item, "Paths": _paths, "Responses": _responses,
}


def encode_document(document: Mapping[str, Any]) -> bytes:
    """A Swagger 2.0 document as a serialized `openapi.v2.Document`."""
    return encode_message("Document", document)


def negotiate(accept: str | None) -> str | None:
    """The content type `/openapi/v2` answers an Accept header with, as kube-openapi's handler
    picks it: media ranges by `q`, the more specific first, then in order; the first that
    matches JSON or one of the protobuf types (JSON for `*/*` and `application/*`: the API server
    lists it first). None: nothing acceptable (the API server's 406)."""
    ranges = []
    for position, clause in enumerate((accept or "*/*").split(",")):
        media, *params = [part.strip() for part in clause.split(";")]
        quality = 1.0
        for param in params:
            name, _, number = param.partition("=")
            if name.strip() == "q":
                try:
                    quality = float(number)
                except ValueError:
                    quality = 0.0
        if quality > 0 and media:
            ranges.append((-quality, media.count("*"), position, media.lower()))
    for *_, media in sorted(ranges):
        if media in PROTOBUF_MEDIA_TYPES:
            return PROTOBUF_CONTENT_TYPE
        if media in ("application/json", "application/*", "*/*"):
            return JSON_CONTENT_TYPE
    return None
