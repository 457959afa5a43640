from agent._proto.deviceplugin.v1beta1 import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Time(_message.Message):
    __slots__ = ("wall_ns", "monotonic_ns")
    WALL_NS_FIELD_NUMBER: _ClassVar[int]
    MONOTONIC_NS_FIELD_NUMBER: _ClassVar[int]
    wall_ns: int
    monotonic_ns: int
    def __init__(self, wall_ns: _Optional[int] = ..., monotonic_ns: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceState(_message.Message):
    __slots__ = ("id", "health", "numa_nodes", "allocated")
    ID_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    health: str
    numa_nodes: _containers.RepeatedScalarFieldContainer[int]
    allocated: bool
    def __init__(self, id: _Optional[str] = ..., health: _Optional[str] = ..., numa_nodes: _Optional[_Iterable[int]] = ..., allocated: bool = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("resource_name", "seq", "received", "devices", "capacity", "allocatable", "registration")
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ALLOCATABLE_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    resource_name: str
    seq: int
    received: Time
    devices: _containers.RepeatedCompositeFieldContainer[DeviceState]
    capacity: int
    allocatable: int
    registration: int
    def __init__(self, resource_name: _Optional[str] = ..., seq: _Optional[int] = ..., received: _Optional[_Union[Time, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[DeviceState, _Mapping]]] = ..., capacity: _Optional[int] = ..., allocatable: _Optional[int] = ..., registration: _Optional[int] = ...) -> None: ...

class ResourceState(_message.Message):
    __slots__ = ("resource_name", "endpoint", "options", "registrations", "connected", "capacity", "allocatable", "devices", "registered", "stream_end_reason", "allocated", "latest_snapshot")
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ALLOCATABLE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    STREAM_END_REASON_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    LATEST_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    resource_name: str
    endpoint: str
    options: _api_pb2.DevicePluginOptions
    registrations: int
    connected: bool
    capacity: int
    allocatable: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceState]
    registered: Time
    stream_end_reason: str
    allocated: int
    latest_snapshot: Snapshot
    def __init__(self, resource_name: _Optional[str] = ..., endpoint: _Optional[str] = ..., options: _Optional[_Union[_api_pb2.DevicePluginOptions, _Mapping]] = ..., registrations: _Optional[int] = ..., connected: bool = ..., capacity: _Optional[int] = ..., allocatable: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[DeviceState, _Mapping]]] = ..., registered: _Optional[_Union[Time, _Mapping]] = ..., stream_end_reason: _Optional[str] = ..., allocated: _Optional[int] = ..., latest_snapshot: _Optional[_Union[Snapshot, _Mapping]] = ...) -> None: ...

class State(_message.Message):
    __slots__ = ("dir", "kubelet_socket", "podresources_socket", "control_socket", "restarts", "resources", "pods", "last_event_seq", "started", "registration_failures")
    DIR_FIELD_NUMBER: _ClassVar[int]
    KUBELET_SOCKET_FIELD_NUMBER: _ClassVar[int]
    PODRESOURCES_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    dir: str
    kubelet_socket: str
    podresources_socket: str
    control_socket: str
    restarts: int
    resources: _containers.RepeatedCompositeFieldContainer[ResourceState]
    pods: _containers.RepeatedCompositeFieldContainer[Pod]
    last_event_seq: int
    started: Time
    registration_failures: int
    def __init__(self, dir: _Optional[str] = ..., kubelet_socket: _Optional[str] = ..., podresources_socket: _Optional[str] = ..., control_socket: _Optional[str] = ..., restarts: _Optional[int] = ..., resources: _Optional[_Iterable[_Union[ResourceState, _Mapping]]] = ..., pods: _Optional[_Iterable[_Union[Pod, _Mapping]]] = ..., last_event_seq: _Optional[int] = ..., started: _Optional[_Union[Time, _Mapping]] = ..., registration_failures: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("after_seq",)
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    def __init__(self, after_seq: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "time", "kind", "resource_name", "message", "endpoint", "snapshot", "pod_namespace", "pod_name", "container_name", "device_ids")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Event.Kind]
        REGISTERED: _ClassVar[Event.Kind]
        REGISTRATION_FAILED: _ClassVar[Event.Kind]
        SNAPSHOT: _ClassVar[Event.Kind]
        STREAM_ENDED: _ClassVar[Event.Kind]
        ALLOCATED: _ClassVar[Event.Kind]
        POD_REJECTED: _ClassVar[Event.Kind]
        POD_DELETED: _ClassVar[Event.Kind]
        RESTARTED: _ClassVar[Event.Kind]
    KIND_UNSPECIFIED: Event.Kind
    REGISTERED: Event.Kind
    REGISTRATION_FAILED: Event.Kind
    SNAPSHOT: Event.Kind
    STREAM_ENDED: Event.Kind
    ALLOCATED: Event.Kind
    POD_REJECTED: Event.Kind
    POD_DELETED: Event.Kind
    RESTARTED: Event.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    POD_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: Time
    kind: Event.Kind
    resource_name: str
    message: str
    endpoint: str
    snapshot: Snapshot
    pod_namespace: str
    pod_name: str
    container_name: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[_Union[Time, _Mapping]] = ..., kind: _Optional[_Union[Event.Kind, str]] = ..., resource_name: _Optional[str] = ..., message: _Optional[str] = ..., endpoint: _Optional[str] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., pod_namespace: _Optional[str] = ..., pod_name: _Optional[str] = ..., container_name: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetSnapshotsRequest(_message.Message):
    __slots__ = ("resource_name", "after_seq")
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    resource_name: str
    after_seq: int
    def __init__(self, resource_name: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class GetSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[Snapshot]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[Snapshot, _Mapping]]] = ...) -> None: ...

class ContainerRequest(_message.Message):
    __slots__ = ("name", "requests")
    class RequestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    requests: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., requests: _Optional[_Mapping[str, int]] = ...) -> None: ...

class AdmitPodRequest(_message.Message):
    __slots__ = ("name", "namespace", "uid", "containers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace: str
    uid: str
    containers: _containers.RepeatedCompositeFieldContainer[ContainerRequest]
    def __init__(self, name: _Optional[str] = ..., namespace: _Optional[str] = ..., uid: _Optional[str] = ..., containers: _Optional[_Iterable[_Union[ContainerRequest, _Mapping]]] = ...) -> None: ...

class ResourceAllocation(_message.Message):
    __slots__ = ("resource_name", "device_ids", "allocate_response", "preferred_called", "preferred_device_ids", "pre_start_called")
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_CALLED_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    PRE_START_CALLED_FIELD_NUMBER: _ClassVar[int]
    resource_name: str
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    allocate_response: _api_pb2.AllocateResponse
    preferred_called: bool
    preferred_device_ids: _containers.RepeatedScalarFieldContainer[str]
    pre_start_called: bool
    def __init__(self, resource_name: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., allocate_response: _Optional[_Union[_api_pb2.AllocateResponse, _Mapping]] = ..., preferred_called: bool = ..., preferred_device_ids: _Optional[_Iterable[str]] = ..., pre_start_called: bool = ...) -> None: ...

class ContainerAllocation(_message.Message):
    __slots__ = ("name", "resources")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    name: str
    resources: _containers.RepeatedCompositeFieldContainer[ResourceAllocation]
    def __init__(self, name: _Optional[str] = ..., resources: _Optional[_Iterable[_Union[ResourceAllocation, _Mapping]]] = ...) -> None: ...

class Pod(_message.Message):
    __slots__ = ("name", "namespace", "uid", "containers", "admitted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace: str
    uid: str
    containers: _containers.RepeatedCompositeFieldContainer[ContainerAllocation]
    admitted: Time
    def __init__(self, name: _Optional[str] = ..., namespace: _Optional[str] = ..., uid: _Optional[str] = ..., containers: _Optional[_Iterable[_Union[ContainerAllocation, _Mapping]]] = ..., admitted: _Optional[_Union[Time, _Mapping]] = ...) -> None: ...

class AdmitPodResponse(_message.Message):
    __slots__ = ("pod",)
    POD_FIELD_NUMBER: _ClassVar[int]
    pod: Pod
    def __init__(self, pod: _Optional[_Union[Pod, _Mapping]] = ...) -> None: ...

class DeletePodRequest(_message.Message):
    __slots__ = ("name", "namespace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    namespace: str
    def __init__(self, name: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class DeletePodResponse(_message.Message):
    __slots__ = ("pod",)
    POD_FIELD_NUMBER: _ClassVar[int]
    pod: Pod
    def __init__(self, pod: _Optional[_Union[Pod, _Mapping]] = ...) -> None: ...

class RestartRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RestartResponse(_message.Message):
    __slots__ = ("restarts", "removed_sockets")
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_SOCKETS_FIELD_NUMBER: _ClassVar[int]
    restarts: int
    removed_sockets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, restarts: _Optional[int] = ..., removed_sockets: _Optional[_Iterable[str]] = ...) -> None: ...

class GetAllocatableHistoryRequest(_message.Message):
    __slots__ = ("resource_name", "after_seq")
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    resource_name: str
    after_seq: int
    def __init__(self, resource_name: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class AllocatableChange(_message.Message):
    __slots__ = ("seq", "resource_name", "cause", "time", "capacity", "allocatable", "instance", "registration")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ALLOCATABLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    resource_name: str
    cause: Event.Kind
    time: Time
    capacity: int
    allocatable: int
    instance: int
    registration: int
    def __init__(self, seq: _Optional[int] = ..., resource_name: _Optional[str] = ..., cause: _Optional[_Union[Event.Kind, str]] = ..., time: _Optional[_Union[Time, _Mapping]] = ..., capacity: _Optional[int] = ..., allocatable: _Optional[int] = ..., instance: _Optional[int] = ..., registration: _Optional[int] = ...) -> None: ...

class GetAllocatableHistoryResponse(_message.Message):
    __slots__ = ("changes",)
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[AllocatableChange]
    def __init__(self, changes: _Optional[_Iterable[_Union[AllocatableChange, _Mapping]]] = ...) -> None: ...
