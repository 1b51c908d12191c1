"""Sans-IO register codecs and the register maps the daemon speaks. No sockets here.

- `words`: register words and the value types they carry (big-endian words, high word first; "not implemented"
  sentinels decode to NaN, never to zero; SunSpec scale factors).
- `blocks`: fields at offsets, blocks decoded and encoded as a whole, fixed records in one numpy pass, the spans
  a client may write.
- `sunspec`: the SunSpec models built from the published definitions pysunspec2 ships (offsets, sizes, scale
  factors, access, 0- or 1-based enums, lengths), never retyped.
- `maps`: the project's own maps, `dimmer-rack-v1` and `dimmer-site-v1`; `building`: `dimmer-building-v1`, a
  building as one load to the campus coordinator.
- `numeric`: the project's own blocks and small record sets decoded with one `struct` pass (a coordinator's reads).
- `docs`: the tables of docs/registers.md, generated.

Everything is re-exported here: `from dimmer.daemon import registers as R` is how the daemon, the agent and the
served plant use them.
"""

# ruff: noqa: F401 (this module re-exports the package)
from __future__ import annotations

from dimmer.daemon.registers.blocks import (
    ILLEGAL_ADDRESS,
    ILLEGAL_VALUE,
    Block,
    Field,
    Span,
    Values,
    decode_block,
    decode_records,
    encode_block,
    encode_records,
    encode_value,
    field_range,
    merge_spans,
    out_of_range,
    span_allowed,
    writable_spans,
    write_error,
)
from dimmer.daemon.registers.building import (
    BUDGET_AT,
    BUDGET_HELD,
    BUDGET_LEN,
    BUDGET_NONE,
    BUDGET_SAFE,
    BUILDING_GROUP,
    BUILDING_GROUP_BASE,
    BUILDING_GROUP_STRIDE,
    BUILDING_HEADER,
    BUILDING_IMAGE_SIZE,
    BUILDING_MAGIC,
    BUILDING_MAX_GROUPS,
    BUILDING_VERSION,
    REPORT_SCALARS,
    building_group_address,
    building_writable_spans,
    building_write_error,
    floor_or_none,
)
from dimmer.daemon.registers.docs import POINTS_USED, registers_markdown
from dimmer.daemon.registers.maps import (
    JOB_ENDED,
    JOB_RUNNING,
    JOB_STOPPED,
    LEASE_EXPIRED,
    LEASE_HELD,
    LEASE_NONE,
    RACK_CMD_BASE,
    RACK_CMD_STRIDE,
    RACK_COMMAND,
    RACK_HEADER,
    RACK_MAGIC,
    RACK_MAX,
    RACK_STATUS,
    RACK_STATUS_BASE,
    RACK_STATUS_STRIDE,
    RACK_VERSION,
    SITE_DOMAIN,
    SITE_DOMAIN_BASE,
    SITE_DOMAIN_STRIDE,
    SITE_HEADER,
    SITE_JOB,
    SITE_JOB_BASE,
    SITE_MAGIC,
    SITE_MAX_DOMAINS,
    SITE_MAX_JOBS,
    SITE_VERSION,
    rack_block,
    rack_cmd_address,
    rack_status_address,
    rack_writable_spans,
    rack_write_error,
    site_domain_address,
)
from dimmer.daemon.registers.numeric import NumericDecoder, RecordDecoder
from dimmer.daemon.registers.sunspec import (
    DEFINITIONS_DIR,
    METERS_FLOAT,
    METERS_INT,
    SPOKEN,
    SUNS_MARKER,
    SUNSPEC_BASES,
    SUNSPEC_END,
    check_suns,
    definition,
    model,
    model_header,
    model_length,
    model_offsets,
    pysunspec2_version,
    sunspec_image,
    symbol,
)
from dimmer.daemon.registers.words import (
    ACC32_NA,
    F32_NA,
    I16_NA,
    I32_NA,
    KINDS,
    MAX_READ,
    MAX_WRITE,
    NA_WORDS,
    SF_MAX,
    SF_MIN,
    SF_NA,
    SIZES,
    U16_NA,
    U32_NA,
    DecodeError,
    EncodeError,
    FloatArray,
    RegisterError,
    WordArray,
    apply_sf,
    as_words,
    decode_acc32,
    decode_float32,
    decode_int16,
    decode_int32,
    decode_kind,
    decode_sf,
    decode_string,
    decode_uint16,
    decode_uint32,
    decoder,
    encode_acc32,
    encode_float32,
    encode_int16,
    encode_int32,
    encode_kind,
    encode_sf,
    encode_string,
    encode_uint16,
    encode_uint32,
    na_words,
    sf_for,
)

# the SunSpec models we speak, by the names the code has always used
MODEL_1 = model(1)
MODEL_124 = model(124)
MODEL_201 = model(201)
MODEL_203 = model(203)
MODEL_213 = model(213)
MODEL_701 = model(701)
MODEL_704 = model(704)
MODEL_713 = model(713)
MODEL_802 = model(802)
SUNSPEC_MODELS: dict[int, Block] = {mid: model(mid) for mid in SPOKEN}
BATTERY_CONNECTED = symbol(802, "State", "CONNECTED")
WSET_MOD_WATTS = symbol(704, "WSetMod", "WATTS")

__all__ = [name for name in dir() if not name.startswith("_") and name != "annotations"]
