"""The OpenAPI v2 document as gnostic's protobuf `openapi.v2.Document`, read back by an independent
decoder: the `protobuf` package, with message descriptors written here by hand from gnostic-models'
openapiv2/OpenAPIv2.proto (field names, numbers and types as declared there). A field our
encoder numbered or typed differently decodes as an unknown field or a wrong value. The real
Go client's reading is in tests/conformance/test_openapi_protobuf.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, unknown_fields
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from moonlease_dev.testbed.kube.openapi import as_swagger2, definition_name, openapi_v2
from moonlease_dev.testbed.kube.openapi_protobuf import (
    JSON_CONTENT_TYPE,
    PROTOBUF_CONTENT_TYPE,
    NotEncodable,
    encode_document,
    negotiate,
)
from moonlease_dev.testbed.kube.resources import BUILTIN_RESOURCES, DEPLOYMENTS, ResourceType
from moonlease_dev.testbed.kube.wire import varint
from moonlease_operator.crd import build_crd

pytestmark = pytest.mark.unit

_ONEOF = "oneof"
_PRIMITIVE = ["type", "format", "items", "collection_format", "default", "maximum", "exclusive_maximum", "minimum",
              "exclusive_minimum", "max_length", "min_length", "pattern", "max_items", "min_items", "unique_items",
              "enum", "multiple_of"]

#: message -> [(field, number, type, oneof?)], copied from OpenAPIv2.proto (package openapi.v2).
#: Types: proto scalar names, a message name, "[]" for repeated.
PROTO: dict[str, list[tuple[Any, ...]]] = {
    "Document": [("swagger", 1, "string"), ("info", 2, "Info"), ("host", 3, "string"), ("base_path", 4, "string"),
                 ("schemes", 5, "[]string"), ("consumes", 6, "[]string"), ("produces", 7, "[]string"),
                 ("paths", 8, "Paths"), ("definitions", 9, "Definitions"), ("vendor_extension", 16, "[]NamedAny")],
    "Info": [("title", 1, "string"), ("version", 2, "string"), ("description", 3, "string"),
             ("terms_of_service", 4, "string"), ("vendor_extension", 7, "[]NamedAny")],
    "Any": [("yaml", 2, "string")],  # field 1 (a google.protobuf.Any) is never written for JSON input
    "NamedAny": [("name", 1, "string"), ("value", 2, "Any")],
    "Definitions": [("additional_properties", 1, "[]NamedSchema")],
    "Properties": [("additional_properties", 1, "[]NamedSchema")],
    "NamedSchema": [("name", 1, "string"), ("value", 2, "Schema")],
    "Schema": [("_ref", 1, "string"), ("format", 2, "string"), ("title", 3, "string"), ("description", 4, "string"),
               ("default", 5, "Any"), ("multiple_of", 6, "double"), ("maximum", 7, "double"),
               ("exclusive_maximum", 8, "bool"), ("minimum", 9, "double"), ("exclusive_minimum", 10, "bool"),
               ("max_length", 11, "int64"), ("min_length", 12, "int64"), ("pattern", 13, "string"),
               ("max_items", 14, "int64"), ("min_items", 15, "int64"), ("unique_items", 16, "bool"),
               ("max_properties", 17, "int64"), ("min_properties", 18, "int64"), ("required", 19, "[]string"),
               ("enum", 20, "[]Any"), ("additional_properties", 21, "AdditionalPropertiesItem"),
               ("type", 22, "TypeItem"), ("items", 23, "ItemsItem"), ("all_of", 24, "[]Schema"),
               ("properties", 25, "Properties"), ("discriminator", 26, "string"), ("read_only", 27, "bool"),
               ("example", 30, "Any"), ("vendor_extension", 31, "[]NamedAny")],
    "AdditionalPropertiesItem": [("schema", 1, "Schema", _ONEOF), ("boolean", 2, "bool", _ONEOF)],
    "TypeItem": [("value", 1, "[]string")],
    "ItemsItem": [("schema", 1, "[]Schema")],
    "Paths": [("vendor_extension", 1, "[]NamedAny"), ("path", 2, "[]NamedPathItem")],
    "NamedPathItem": [("name", 1, "string"), ("value", 2, "PathItem")],
    "PathItem": [("_ref", 1, "string"), ("get", 2, "Operation"), ("put", 3, "Operation"), ("post", 4, "Operation"),
                 ("delete", 5, "Operation"), ("options", 6, "Operation"), ("head", 7, "Operation"),
                 ("patch", 8, "Operation"), ("parameters", 9, "[]ParametersItem"),
                 ("vendor_extension", 10, "[]NamedAny")],
    "Operation": [("tags", 1, "[]string"), ("summary", 2, "string"), ("description", 3, "string"),
                  ("operation_id", 5, "string"), ("produces", 6, "[]string"), ("consumes", 7, "[]string"),
                  ("parameters", 8, "[]ParametersItem"), ("responses", 9, "Responses"), ("schemes", 10, "[]string"),
                  ("deprecated", 11, "bool"), ("vendor_extension", 13, "[]NamedAny")],
    "ParametersItem": [("parameter", 1, "Parameter", _ONEOF), ("json_reference", 2, "JsonReference", _ONEOF)],
    "JsonReference": [("_ref", 1, "string"), ("description", 2, "string")],
    "Parameter": [("body_parameter", 1, "BodyParameter", _ONEOF),
                  ("non_body_parameter", 2, "NonBodyParameter", _ONEOF)],
    "BodyParameter": [("description", 1, "string"), ("name", 2, "string"), ("in", 3, "string"),
                      ("required", 4, "bool"), ("schema", 5, "Schema"), ("vendor_extension", 6, "[]NamedAny")],
    "NonBodyParameter": [("header_parameter_sub_schema", 1, "HeaderParameterSubSchema", _ONEOF),
                         ("form_data_parameter_sub_schema", 2, "FormDataParameterSubSchema", _ONEOF),
                         ("query_parameter_sub_schema", 3, "QueryParameterSubSchema", _ONEOF),
                         ("path_parameter_sub_schema", 4, "PathParameterSubSchema", _ONEOF)],
    "PrimitivesItems": [(name, number, None) for number, name in enumerate(_PRIMITIVE, 1)]
    + [("vendor_extension", 18, "[]NamedAny")],
    "Responses": [("response_code", 1, "[]NamedResponseValue"), ("vendor_extension", 2, "[]NamedAny")],
    "NamedResponseValue": [("name", 1, "string"), ("value", 2, "ResponseValue")],
    "ResponseValue": [("response", 1, "Response", _ONEOF), ("json_reference", 2, "JsonReference", _ONEOF)],
    "Response": [("description", 1, "string"), ("schema", 2, "SchemaItem"), ("vendor_extension", 5, "[]NamedAny")],
    "SchemaItem": [("schema", 1, "Schema", _ONEOF)],
}
# Query and formData parameters: required 1, in 2, description 3, name 4, allow_empty_value 5,
# then the primitive fields from 6 and vendor_extension 23; header and path parameters have no
# allow_empty_value: the primitive fields from 5, vendor_extension 22.
_HEAD = [("required", 1, "bool"), ("in", 2, "string"), ("description", 3, "string"), ("name", 4, "string")]
for _message, _first, _extra in (("QueryParameterSubSchema", 6, True), ("FormDataParameterSubSchema", 6, True),
                                 ("HeaderParameterSubSchema", 5, False), ("PathParameterSubSchema", 5, False)):
    PROTO[_message] = [*_HEAD, *([("allow_empty_value", 5, "bool")] if _extra else []),
                       *[(name, number, None) for number, name in enumerate(_PRIMITIVE, _first)],
                       ("vendor_extension", _first + len(_PRIMITIVE), "[]NamedAny")]
_PRIMITIVE_TYPES = {"type": "string", "format": "string", "items": "PrimitivesItems", "collection_format": "string",
                    "default": "Any", "maximum": "double", "exclusive_maximum": "bool", "minimum": "double",
                    "exclusive_minimum": "bool", "max_length": "int64", "min_length": "int64", "pattern": "string",
                    "max_items": "int64", "min_items": "int64", "unique_items": "bool", "enum": "[]Any",
                    "multiple_of": "double"}

_SCALARS = {"string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
            "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
            "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
            "double": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE}


def _document_class() -> type[Message]:
    """openapi.v2.Document as a protobuf message class, built from `PROTO`."""
    file = descriptor_pb2.FileDescriptorProto(name="test_openapiv2.proto", package="openapi.v2", syntax="proto3")
    for name, fields in PROTO.items():
        message = file.message_type.add(name=name)
        if any(len(field) > 3 for field in fields):
            message.oneof_decl.add(name="oneof")
        for field_name, number, kind, *oneof in fields:
            kind = kind or (_PRIMITIVE_TYPES[field_name] if field_name != "enum" else "[]Any")
            repeated = kind.startswith("[]")
            kind = kind.removeprefix("[]")
            field = message.field.add(name=field_name, number=number, label=(
                descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED if repeated
                else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL))
            if kind in _SCALARS:
                field.type = _SCALARS[kind]
            else:
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
                field.type_name = f".openapi.v2.{kind}"
            if oneof:
                field.oneof_index = 0
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("openapi.v2.Document"))


DOCUMENT = _document_class()


def decode(data: bytes) -> Message:
    """Parse, and fail on any field the proto does not declare where we wrote it."""
    document = DOCUMENT()
    document.ParseFromString(data)
    _assert_no_unknown_fields(document, "Document")
    return document


def _assert_no_unknown_fields(message: Message, where: str) -> None:
    assert len(unknown_fields.UnknownFieldSet(message)) == 0, f"{where}: fields the proto does not declare"
    for field, value in message.ListFields():
        if field.type != descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE:
            continue
        for index, item in enumerate(value if field.is_repeated else [value]):
            _assert_no_unknown_fields(item, f"{where}.{field.name}[{index}]")


def as_dict(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True)


SMALL = {
    "swagger": "2.0",
    "info": {"title": "Kubernetes", "version": "v1.32.0"},
    "paths": {
        "/apis/example.com/v1/widgets/{name}": {
            "parameters": [{"name": "name", "in": "path", "required": True, "type": "string"}],
            "patch": {
                "operationId": "patchWidget", "consumes": ["application/merge-patch+json"],
                "x-kubernetes-action": "patch",
                "parameters": [{"name": "dryRun", "in": "query", "type": "string", "uniqueItems": True},
                               {"name": "body", "in": "body", "required": True,
                                "schema": {"$ref": "#/definitions/com.example.v1.Widget"}}],
                "responses": {"200": {"description": "OK", "schema": {"$ref": "#/definitions/com.example.v1.Widget"}}},
            },
        },
    },
    "definitions": {
        "com.example.v1.Widget": {
            "type": "object", "description": "A widget.", "required": ["spec"],
            "properties": {
                "spec": {"type": "object", "additionalProperties": False, "properties": {
                    "size": {"type": "integer", "format": "int32", "minimum": 0, "maximum": 300,
                             "exclusiveMaximum": True, "default": 3},
                    "ratio": {"type": "number", "minimum": -2.5},
                    "name": {"type": "string", "maxLength": 300, "pattern": "^[a-z]+$", "enum": ["a", "bc"]},
                    "tags": {"type": "array", "minItems": 1, "items": {"type": "string"},
                             "x-kubernetes-list-type": "set"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "owner": {"$ref": "#/definitions/com.example.v1.Owner"},
                }},
            },
            "x-kubernetes-group-version-kind": [{"group": "example.com", "version": "v1", "kind": "Widget"}],
            "x-kubernetes-preserve-unknown-fields": True,
        },
        "com.example.v1.Owner": {"type": "object", "properties": {"name": {"type": "string"}}},
    },
}


def test_a_small_document_decodes_field_for_field() -> None:
    document = decode(encode_document(SMALL))
    assert (document.swagger, document.info.title, document.info.version) == ("2.0", "Kubernetes", "v1.32.0")
    definitions = {named.name: named.value for named in document.definitions.additional_properties}
    assert list(definitions) == ["com.example.v1.Widget", "com.example.v1.Owner"]  # the document's order
    widget = definitions["com.example.v1.Widget"]
    assert list(widget.type.value) == ["object"] and widget.description == "A widget."
    assert list(widget.required) == ["spec"]
    extensions = {named.name: yaml.safe_load(named.value.yaml) for named in widget.vendor_extension}
    assert extensions == {"x-kubernetes-group-version-kind": [{"group": "example.com", "version": "v1",
                                                              "kind": "Widget"}],
                          "x-kubernetes-preserve-unknown-fields": True}
    spec = widget.properties.additional_properties[0]
    assert spec.name == "spec"
    # `additionalProperties: false` is a oneof member: written, and read back as false.
    assert spec.value.additional_properties.WhichOneof("oneof") == "boolean"
    assert spec.value.additional_properties.boolean is False
    fields = {named.name: named.value for named in spec.value.properties.additional_properties}
    assert list(fields) == ["size", "ratio", "name", "tags", "labels", "owner"]
    assert as_dict(fields["size"]) == {"format": "int32", "default": {"yaml": "3\n"}, "maximum": 300.0,
                                       "exclusive_maximum": True, "type": {"value": ["integer"]}}
    assert fields["size"].minimum == 0.0  # proto3: a zero is not written, and reads as zero
    assert fields["ratio"].minimum == -2.5
    assert fields["name"].max_length == 300 and fields["name"].pattern == "^[a-z]+$"
    assert [yaml.safe_load(item.yaml) for item in fields["name"].enum] == ["a", "bc"]
    tags = fields["tags"]
    assert tags.min_items == 1 and [list(s.type.value) for s in tags.items.schema] == [["string"]]
    assert [(e.name, e.value.yaml) for e in tags.vendor_extension] == [("x-kubernetes-list-type", "set\n")]
    assert fields["labels"].additional_properties.WhichOneof("oneof") == "schema"
    assert list(fields["labels"].additional_properties.schema.type.value) == ["string"]
    assert fields["owner"]._ref == "#/definitions/com.example.v1.Owner"

    [path] = document.paths.path
    assert path.name == "/apis/example.com/v1/widgets/{name}"
    [name_parameter] = path.value.parameters
    assert as_dict(name_parameter) == {"parameter": {"non_body_parameter": {"path_parameter_sub_schema": {
        "required": True, "in": "path", "name": "name", "type": "string"}}}}
    patch = path.value.patch
    assert patch.operation_id == "patchWidget" and list(patch.consumes) == ["application/merge-patch+json"]
    assert [(e.name, e.value.yaml) for e in patch.vendor_extension] == [("x-kubernetes-action", "patch\n")]
    query, body = patch.parameters
    assert as_dict(query) == {"parameter": {"non_body_parameter": {"query_parameter_sub_schema": {
        "in": "query", "name": "dryRun", "type": "string", "unique_items": True}}}}
    assert as_dict(body) == {"parameter": {"body_parameter": {
        "name": "body", "in": "body", "required": True, "schema": {"_ref": "#/definitions/com.example.v1.Widget"}}}}
    [response] = patch.responses.response_code
    assert as_dict(response) == {"name": "200", "value": {"response": {
        "description": "OK", "schema": {"schema": {"_ref": "#/definitions/com.example.v1.Widget"}}}}}


def test_fields_are_written_in_number_order_with_the_wire_types_of_the_proto() -> None:
    owner = {"type": "object", "description": "d", "x-a": 1, "$ref": "#/r"}
    schema = (b"\x0a\x03#/r"  # _ref 1, length-delimited
              b"\x22\x01d"  # description 4
              b"\xb2\x01\x08\x0a\x06object"  # type 22 (a two-byte key): TypeItem{value 1}
              b"\xfa\x01\x0b\x0a\x03x-a\x12\x04\x12\x021\n")  # vendor_extension 31: NamedAny{name, Any{yaml 2}}
    named = b"\x0a\x01O\x12" + bytes([len(schema)]) + schema  # NamedSchema{name 1, value 2}
    definitions = b"\x0a" + bytes([len(named)]) + named  # Definitions{additional_properties 1}
    # Document: swagger (1) before definitions (9), whatever the JSON's order.
    assert encode_document({"definitions": {"O": owner}, "swagger": "2.0"}) == (
        b"\x0a\x032.0\x4a" + bytes([len(definitions)]) + definitions)
    # A double is fixed64 (wire type 1, little-endian), a bool and an int64 varints (wire type 0).
    ratio = encode_document({"definitions": {"R": {"minimum": 1.5, "maxLength": 2, "uniqueItems": True}}})
    assert ratio.endswith(b"\x49\x00\x00\x00\x00\x00\x00\xf8\x3f"  # minimum 9
                          b"\x58\x02"  # max_length 11
                          b"\x80\x01\x01")  # unique_items 16


def test_varints_are_base_128_and_negative_numbers_are_ten_bytes() -> None:
    assert varint(0) == b"\x00" and varint(1) == b"\x01" and varint(300) == b"\xac\x02"
    assert varint(-1) == b"\xff" * 9 + b"\x01"
    negative = decode(encode_document({"definitions": {"N": {"minLength": -1}}}))
    assert negative.definitions.additional_properties[0].value.min_length == -1


@pytest.mark.parametrize(("document", "message"), [
    ({"definitions": {"A": {"nullable": True}}}, ".definitions.A.nullable: Schema has no field 'nullable'"),
    ({"definitions": {"A": {"type": ["object", 3]}}}, "expected a string"),
    ({"definitions": {"A": {"type": 3}}}, "expected a list"),
    ({"definitions": {"A": {"maxLength": 1.5}}}, "expected an integer"),
    ({"definitions": {"A": {"minimum": True}}}, "expected a number"),
    ({"paths": {"/a": {"get": {"parameters": [{"name": "c", "in": "cookie"}]}}}}, "'cookie' is not a parameter"),
    ({"paths": {"/a": {"get": {"responses": {"200": {"schema": {"type": "file"}}}}}}}, "file schemas"),
    ({"openapi": "3.0.0"}, "Document has no field 'openapi'"),
])
def test_what_swagger_2_has_no_place_for_is_refused(document: dict[str, Any], message: str) -> None:
    with pytest.raises(NotEncodable, match=re.escape(message)):
        encode_document(document)


def test_the_served_document_decodes_whole() -> None:
    """Every definition and path of what the local API server serves (built-in kinds' schemas and
    the project's CRD), read back with the same names, types and extensions as the JSON."""
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    policy = ResourceType(crd["spec"]["group"], version["name"], crd["spec"]["names"]["plural"],
                          crd["spec"]["names"]["kind"], True, custom=True)
    source = openapi_v2([*((rtype, None) for rtype in BUILTIN_RESOURCES),
                         (policy, version["schema"]["openAPIV3Schema"])])
    document = decode(encode_document(source))
    decoded = {named.name: named.value for named in document.definitions.additional_properties}
    assert list(decoded) == list(source["definitions"])
    assert [named.name for named in document.paths.path] == list(source["paths"])

    def same(schema: Message, json_schema: dict[str, Any], where: str) -> None:
        assert schema._ref == json_schema.get("$ref", ""), where
        assert list(schema.type.value) == ([json_schema["type"]] if "type" in json_schema else []), where
        assert schema.description == json_schema.get("description", ""), where
        assert list(schema.required) == json_schema.get("required", []), where
        assert {e.name: yaml.safe_load(e.value.yaml) for e in schema.vendor_extension} == {
            key: value for key, value in json_schema.items() if key.startswith("x-")}, where
        if "default" in json_schema:
            assert yaml.safe_load(schema.default.yaml) == json_schema["default"], where
        properties = {named.name: named.value for named in schema.properties.additional_properties}
        assert list(properties) == list(json_schema.get("properties", {})), where
        for name, sub in properties.items():
            same(sub, json_schema["properties"][name], f"{where}.{name}")
        if "items" in json_schema:
            same(schema.items.schema[0], json_schema["items"], f"{where}[]")

    for name, schema in decoded.items():
        same(schema, source["definitions"][name], name)
    assert definition_name(DEPLOYMENTS) in decoded and definition_name(policy) in decoded


@pytest.mark.parametrize(("accept", "answer"), [
    ("application/com.github.proto-openapi.spec.v2@v1.0+protobuf", PROTOBUF_CONTENT_TYPE),  # client-go
    ("application/com.github.proto-openapi.spec.v2.v1.0+protobuf", PROTOBUF_CONTENT_TYPE),
    ("application/json", JSON_CONTENT_TYPE),
    (None, JSON_CONTENT_TYPE), ("*/*", JSON_CONTENT_TYPE), ("application/*", JSON_CONTENT_TYPE),
    ("application/json;q=0.5, application/com.github.proto-openapi.spec.v2@v1.0+protobuf", PROTOBUF_CONTENT_TYPE),
    ("application/com.github.proto-openapi.spec.v2@v1.0+protobuf;q=0.5, application/json", JSON_CONTENT_TYPE),
    ("*/*, application/com.github.proto-openapi.spec.v2.v1.0+protobuf", PROTOBUF_CONTENT_TYPE),  # the specific first
    ("text/html", None), ("application/json;q=0", None),
])
def test_the_content_type_is_negotiated_as_kube_openapi_does(accept: str | None, answer: str | None) -> None:
    assert negotiate(accept) == answer


def test_custom_schemas_are_published_in_v2_without_v3_only_keywords() -> None:
    schema = {"type": "object", "required": ["a", "b", "c"], "properties": {
        "a": {"type": "string", "nullable": True},
        "b": {"type": "array", "items": {"type": "string"}, "oneOf": [{"maxItems": 1}]},
        "c": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"d": {"type": "string"}}},
        "e": {"type": "array", "x-kubernetes-preserve-unknown-fields": True, "items": {"type": "string"}},
        "f": {"type": "object", "additionalProperties": {"type": "string", "nullable": True},
              "required": ["g"], "anyOf": [{"required": ["g"]}], "not": {"required": ["h"]}},
    }}
    assert as_swagger2(schema) == {"type": "object", "required": ["b", "c"], "properties": {
        "a": {},
        "b": {"type": "array", "items": {"type": "string"}},
        "c": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "e": {"x-kubernetes-preserve-unknown-fields": True},
        "f": {"type": "object", "additionalProperties": {}},
    }}


@pytest.mark.parametrize(("where", "message"), [("query", "query_parameter_sub_schema"),
                                                ("formData", "form_data_parameter_sub_schema"),
                                                ("header", "header_parameter_sub_schema"),
                                                ("path", "path_parameter_sub_schema")])
def test_non_body_parameters_keep_every_primitive_field(where: str, message: str) -> None:
    parameter = {"name": "n", "in": where, "description": "d", "required": True, "type": "array", "format": "f",
                 "items": {"type": "integer", "maximum": 9, "items": {"type": "string", "pattern": "p"}},
                 "collectionFormat": "csv", "default": [1], "maximum": 5, "exclusiveMaximum": True, "minimum": -5,
                 "exclusiveMinimum": True, "maxLength": 7, "minLength": 1, "pattern": "^a", "maxItems": 3,
                 "minItems": 1, "uniqueItems": True, "enum": [[1]], "multipleOf": 0.5, "x-note": "v"}
    if where in ("query", "formData"):
        parameter["allowEmptyValue"] = True
    document = decode(encode_document({"paths": {"/a": {"get": {"parameters": [parameter]}}}}))
    decoded = as_dict(document.paths.path[0].value.get.parameters[0])["parameter"]["non_body_parameter"][message]
    assert decoded == {
        "name": "n", "in": where, "description": "d", "required": True, "type": "array", "format": "f",
        "items": {"type": "integer", "maximum": 9.0, "items": {"type": "string", "pattern": "p"}},
        "collection_format": "csv", "default": {"yaml": "- 1\n"}, "maximum": 5.0, "exclusive_maximum": True,
        "minimum": -5.0, "exclusive_minimum": True, "max_length": "7", "min_length": "1", "pattern": "^a",
        "max_items": "3", "min_items": "1", "unique_items": True, "enum": [{"yaml": "- 1\n"}], "multiple_of": 0.5,
        "vendor_extension": [{"name": "x-note", "value": {"yaml": "v\n"}}],
        **({"allow_empty_value": True} if where in ("query", "formData") else {})}
