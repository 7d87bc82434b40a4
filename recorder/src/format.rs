//! Bundle framing: writer and reader.
//!
//! ```text
//! file    := header frame* trailer-frame
//! header  := "LMRRBNDL" | format_version u32 LE | contract_version u32 LE    (16 bytes)
//! frame   := kind u8 | 0 u8 | 0 u16 | comp_len u32 LE | raw_len u32 LE
//!            | checksum [8] (first 8 bytes of SHA-256 of the payload)        (20 bytes)
//!            | payload [comp_len] (zstd of the bincode of the frame's value)
//! kinds   := 1 manifest (first, once) | 2 events | 3 trailer (last, once)
//!            | 4 traffic manifest (first, once) | 5 traffic events
//! ```
//!
//! Two kinds of bundle share this framing, its integrity checks and its
//! limits, and differ in their manifest frame's kind ([`Kind`]): a *session*
//! bundle (kinds 1, 2, 3: `lmrr run --record`, `lmrr serve`) and a *traffic*
//! bundle (kinds 4, 5, 3: `lmrr proxy`, schema in [`crate::traffic`]). A
//! reader asked for one kind that finds the other says so by name.
//!
//! The writer appends a frame of events every `flush_every_steps` steps and
//! flushes it to the OS, so a recorder killed with SIGKILL leaves every frame
//! written before. The trailer holds the SHA-256 of every byte before it and
//! summary counts. The reader checks, in order: size limit, magic, version,
//! then per frame: header complete, lengths within limits and within the file,
//! checksum, decompressed size, decode, kind order. A file that ends early (mid
//! frame, or with no trailer) is *truncated*: readable up to its last complete
//! frame and flagged. Anything else that is wrong is *corrupt*: an error naming
//! the frame index and byte offset.

use std::io::Write;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::codec;
use crate::schema::{Event, Manifest, Trailer, FORMAT_VERSION, MIN_READ_VERSION};
use crate::traffic::{TrafficEvent, TrafficManifest};

pub const MAGIC: [u8; 8] = *b"LMRRBNDL";
pub const HEADER_LEN: usize = 16;
pub const FRAME_HEADER_LEN: usize = 20;
/// Largest compressed frame accepted (a frame holds a few steps; the largest
/// legitimate ones — a long prompt's arrival — are a few hundred KB).
pub const MAX_FRAME_COMPRESSED: usize = 64 << 20;
/// Largest decompressed frame accepted; also bincode's allocation limit.
pub const MAX_FRAME_RAW: usize = 256 << 20;
/// Largest bundle file read.
pub const MAX_BUNDLE_BYTES: u64 = 2 << 30;
/// zstd level: fast, and bundles are small anyway.
const ZSTD_LEVEL: i32 = 3;

const KIND_MANIFEST: u8 = 1;
const KIND_EVENTS: u8 = 2;
const KIND_TRAILER: u8 = 3;
const KIND_TRAFFIC_MANIFEST: u8 = 4;
const KIND_TRAFFIC_EVENTS: u8 = 5;
const KIND_LAST: u8 = KIND_TRAFFIC_EVENTS;

/// What a bundle holds: its manifest and event types and their frame kinds.
pub trait Kind {
    type Manifest: Serialize + DeserializeOwned + Clone + std::fmt::Debug;
    type Event: Serialize + DeserializeOwned + Clone + std::fmt::Debug;
    /// Frame kind of the manifest (first frame).
    const MANIFEST: u8;
    /// Frame kind of a batch of events.
    const EVENTS: u8;
    /// What this kind is, for messages ("a session bundle").
    const WHAT: &'static str;
    /// Format version the manifest states (must match the header's).
    fn format_version(m: &Self::Manifest) -> u32;
    /// Contract version written in the header.
    fn contract_version(m: &Self::Manifest) -> u32;
    /// Whether an event counts in the trailer's `steps` (and triggers the
    /// writer's periodic flush).
    fn is_step(e: &Self::Event) -> bool;
    /// The manifest of a bundle of format `version` from its encoded bytes
    /// (an older format's manifest is brought to this one's).
    fn decode_manifest(version: u32, raw: &[u8]) -> Result<Self::Manifest, String> {
        let _ = version;
        codec::decode(raw)
    }
}

/// A session recording: requests, scheduling, steps.
#[derive(Debug, Clone, Copy)]
pub struct Session;

impl Kind for Session {
    type Manifest = Manifest;
    type Event = Event;
    const MANIFEST: u8 = KIND_MANIFEST;
    const EVENTS: u8 = KIND_EVENTS;
    const WHAT: &'static str = "a session bundle (`lmrr run --record`, `lmrr serve`)";
    fn format_version(m: &Manifest) -> u32 {
        m.format_version
    }
    fn contract_version(m: &Manifest) -> u32 {
        m.contract_version
    }
    fn is_step(e: &Event) -> bool {
        matches!(e, Event::Step(_) | Event::PdStep(_))
    }
    fn decode_manifest(version: u32, raw: &[u8]) -> Result<Manifest, String> {
        match version {
            ..=3 => codec::decode::<crate::schema::ManifestV3>(raw).map(Manifest::from),
            4 => codec::decode::<crate::schema::ManifestV4>(raw).map(Manifest::from),
            _ => codec::decode(raw),
        }
    }
}

/// A traffic recording: HTTP requests and responses seen by `lmrr proxy`.
#[derive(Debug, Clone, Copy)]
pub struct Traffic;

impl Kind for Traffic {
    type Manifest = TrafficManifest;
    type Event = TrafficEvent;
    const MANIFEST: u8 = KIND_TRAFFIC_MANIFEST;
    const EVENTS: u8 = KIND_TRAFFIC_EVENTS;
    const WHAT: &'static str = "a traffic bundle (`lmrr proxy`)";
    fn format_version(m: &TrafficManifest) -> u32 {
        m.format_version
    }
    fn contract_version(m: &TrafficManifest) -> u32 {
        m.contract_version
    }
    fn is_step(e: &TrafficEvent) -> bool {
        e.ends_request()
    }
}

/// What the manifest frame of kind `k` says the bundle is.
fn kind_name(k: u8) -> &'static str {
    match k {
        KIND_MANIFEST => Session::WHAT,
        KIND_TRAFFIC_MANIFEST => Traffic::WHAT,
        _ => "not a manifest",
    }
}

/// Errors reading or writing a bundle.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("writing bundle")]
    Write(#[source] std::io::Error),
    #[error("encoding bundle frame: {0}")]
    Encode(String),
    #[error("bundle is {size} bytes, the limit is {limit}")]
    TooLarge { size: u64, limit: u64 },
    #[error("not an lmrr bundle: starts with {found:?}, expected {expected:?}")]
    Foreign { found: String, expected: String },
    #[error(
        "bundle format version {found}, this lmrr reads {}{}",
        if *oldest == *supported {
            format!("version {supported}")
        } else {
            format!("versions {oldest} to {supported}")
        },
        if *found < *oldest {
            format!(
                ": the bundle was written by an older lmrr ({}); replay it with that \
                 version, or record the session again",
                crate::schema::format_change(*found)
            )
        } else {
            ": the bundle was written by a newer lmrr".into()
        }
    )]
    Version {
        found: u32,
        oldest: u32,
        supported: u32,
    },
    #[error("corrupt bundle: frame {frame} at byte {offset}: {what}")]
    Corrupt {
        frame: usize,
        offset: u64,
        what: String,
    },
    #[error("bundle truncated before its manifest ({size} bytes): nothing to read")]
    NoManifest { size: u64 },
    #[error("this is {found}, expected {expected}{hint}")]
    WrongKind {
        found: &'static str,
        expected: &'static str,
        hint: &'static str,
    },
}

/// Whether the bundle was read to its trailer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Integrity {
    /// Trailer present, SHA-256 and counts verified.
    Complete { sha256: [u8; 32] },
    /// The file ends early; everything up to `offset` (frame `frames`) was read.
    Truncated {
        frames: usize,
        offset: u64,
        why: String,
    },
}

impl std::fmt::Display for Integrity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Complete { sha256 } => {
                write!(f, "complete, sha256 {}", lmrr_engine::digest::hex(sha256))
            }
            Self::Truncated {
                frames,
                offset,
                why,
            } => {
                write!(
                    f,
                    "TRUNCATED after {frames} complete frames (byte {offset}): {why}"
                )
            }
        }
    }
}

/// A bundle of kind `K` read into memory.
#[derive(Debug, Clone)]
pub struct BundleOf<K: Kind> {
    pub manifest: K::Manifest,
    pub events: Vec<K::Event>,
    /// Frames read (manifest and trailer included).
    pub frames: usize,
    /// Bytes in the file.
    pub size: u64,
    pub integrity: Integrity,
}

/// A session bundle read into memory.
pub type Bundle = BundleOf<Session>;

/// A session bundle's writer.
pub type BundleWriter<W> = Writer<W, Session>;

/// Appends frames of a bundle of kind `K` to `out`.
pub struct Writer<W: Write, K: Kind> {
    out: W,
    hasher: Sha256,
    frames: u32,
    events: u64,
    steps: u64,
    pending: Vec<K::Event>,
    pending_steps: usize,
    flush_every_steps: usize,
}

impl<W: Write, K: Kind> Writer<W, K> {
    /// Writes the header and the manifest frame.
    pub fn new(
        out: W,
        manifest: &K::Manifest,
        flush_every_steps: usize,
    ) -> Result<Self, BundleError> {
        let mut w = Self {
            out,
            hasher: Sha256::new(),
            frames: 0,
            events: 0,
            steps: 0,
            pending: Vec::new(),
            pending_steps: 0,
            flush_every_steps: flush_every_steps.max(1),
        };
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&K::contract_version(manifest).to_le_bytes());
        w.put(&header)?;
        w.frame(K::MANIFEST, manifest)?;
        w.out.flush().map_err(BundleError::Write)?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), BundleError> {
        self.hasher.update(bytes);
        self.out.write_all(bytes).map_err(BundleError::Write)
    }

    fn frame<T: Serialize>(&mut self, kind: u8, value: &T) -> Result<(), BundleError> {
        let raw = codec::encode(value).map_err(BundleError::Encode)?;
        let payload = zstd::bulk::compress(&raw, ZSTD_LEVEL).map_err(BundleError::Write)?;
        if payload.len() > MAX_FRAME_COMPRESSED || raw.len() > MAX_FRAME_RAW {
            return Err(BundleError::Encode(format!(
                "frame of {} bytes ({} compressed) exceeds the reader's limits",
                raw.len(),
                payload.len()
            )));
        }
        let mut h = Vec::with_capacity(FRAME_HEADER_LEN);
        h.push(kind);
        h.push(0);
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        h.extend_from_slice(&(raw.len() as u32).to_le_bytes());
        h.extend_from_slice(&Sha256::digest(&payload)[..8]);
        self.put(&h)?;
        self.put(&payload)?;
        self.frames += 1;
        Ok(())
    }

    /// Buffers an event; writes and flushes a frame every `flush_every_steps` steps.
    pub fn push(&mut self, e: K::Event) -> Result<(), BundleError> {
        if K::is_step(&e) {
            self.steps += 1;
            self.pending_steps += 1;
        }
        self.events += 1;
        self.pending.push(e);
        if self.pending_steps >= self.flush_every_steps {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes buffered events as a frame and flushes it to the OS.
    pub fn flush(&mut self) -> Result<(), BundleError> {
        if !self.pending.is_empty() {
            let events = std::mem::take(&mut self.pending);
            self.frame(K::EVENTS, &events)?;
            self.pending_steps = 0;
        }
        self.out.flush().map_err(BundleError::Write)
    }

    /// Writes the remaining events and the trailer; returns the sink.
    pub fn finish(mut self) -> Result<W, BundleError> {
        self.flush()?;
        let trailer = Trailer {
            frames: self.frames,
            events: self.events,
            steps: self.steps,
            sha256: self.hasher.clone().finalize().into(),
        };
        self.frame(KIND_TRAILER, &trailer)?;
        self.out.flush().map_err(BundleError::Write)?;
        Ok(self.out)
    }
}

/// Reads a session bundle file.
pub fn open(path: &Path) -> Result<Bundle, BundleError> {
    open_as::<Session>(path)
}

/// Reads a bundle file of kind `K`.
pub fn open_as<K: Kind>(path: &Path) -> Result<BundleOf<K>, BundleError> {
    let io = |source| BundleError::Io {
        path: path.display().to_string(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if meta.len() > MAX_BUNDLE_BYTES {
        return Err(BundleError::TooLarge {
            size: meta.len(),
            limit: MAX_BUNDLE_BYTES,
        });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    read_as::<K>(&bytes)
}

/// One frame's header, validated against the limits.
struct FrameHeader {
    kind: u8,
    comp_len: usize,
    raw_len: usize,
    checksum: [u8; 8],
}

/// Outcome of reading one frame.
enum Next<'a> {
    Frame(FrameHeader, &'a [u8]),
    End,
    Truncated(String),
}

fn next_frame(bytes: &[u8], off: usize, index: usize) -> Result<Next<'_>, BundleError> {
    let rest = &bytes[off..];
    if rest.is_empty() {
        return Ok(Next::End);
    }
    let corrupt = |what: String| BundleError::Corrupt {
        frame: index,
        offset: off as u64,
        what,
    };
    if rest.len() < FRAME_HEADER_LEN {
        return Ok(Next::Truncated(format!(
            "frame {index} header is {} of {FRAME_HEADER_LEN} bytes",
            rest.len()
        )));
    }
    let u32_at =
        |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]) as usize;
    let kind = rest[0];
    if !(KIND_MANIFEST..=KIND_LAST).contains(&kind) || rest[1] != 0 || rest[2] != 0 || rest[3] != 0
    {
        return Err(corrupt(format!(
            "bad frame header (kind {kind}, flags {:02x}{:02x}{:02x})",
            rest[1], rest[2], rest[3]
        )));
    }
    let (comp_len, raw_len) = (u32_at(4), u32_at(8));
    if comp_len > MAX_FRAME_COMPRESSED {
        return Err(corrupt(format!(
            "payload claims {comp_len} bytes, limit {MAX_FRAME_COMPRESSED}"
        )));
    }
    if raw_len > MAX_FRAME_RAW {
        return Err(corrupt(format!(
            "payload claims {raw_len} bytes decompressed, limit {MAX_FRAME_RAW}"
        )));
    }
    let mut checksum = [0u8; 8];
    checksum.copy_from_slice(&rest[12..20]);
    let avail = rest.len() - FRAME_HEADER_LEN;
    if comp_len > avail {
        return Ok(Next::Truncated(format!(
            "frame {index} claims {comp_len} payload bytes, {avail} remain"
        )));
    }
    Ok(Next::Frame(
        FrameHeader {
            kind,
            comp_len,
            raw_len,
            checksum,
        },
        &rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + comp_len],
    ))
}

fn payload<T: DeserializeOwned>(
    h: &FrameHeader,
    data: &[u8],
    index: usize,
    off: usize,
) -> Result<T, BundleError> {
    let raw = payload_bytes(h, data, index, off)?;
    codec::decode(&raw).map_err(|e| BundleError::Corrupt {
        frame: index,
        offset: off as u64,
        what: format!("decoding: {e}"),
    })
}

/// A frame's payload checked and decompressed, not yet decoded.
fn payload_bytes(
    h: &FrameHeader,
    data: &[u8],
    index: usize,
    off: usize,
) -> Result<Vec<u8>, BundleError> {
    let corrupt = |what: String| BundleError::Corrupt {
        frame: index,
        offset: off as u64,
        what,
    };
    if Sha256::digest(data)[..8] != h.checksum {
        return Err(corrupt("checksum mismatch".into()));
    }
    let raw = zstd::bulk::decompress(data, h.raw_len).map_err(|e| corrupt(format!("zstd: {e}")))?;
    if raw.len() != h.raw_len {
        return Err(corrupt(format!(
            "decompressed to {} bytes, header says {}",
            raw.len(),
            h.raw_len
        )));
    }
    Ok(raw)
}

/// Reads a session bundle from bytes.
pub fn read(bytes: &[u8]) -> Result<Bundle, BundleError> {
    read_as::<Session>(bytes)
}

/// Reads a bundle of kind `K` from bytes.
pub fn read_as<K: Kind>(bytes: &[u8]) -> Result<BundleOf<K>, BundleError> {
    let size = bytes.len() as u64;
    if size > MAX_BUNDLE_BYTES {
        return Err(BundleError::TooLarge {
            size,
            limit: MAX_BUNDLE_BYTES,
        });
    }
    let head = &bytes[..bytes.len().min(MAGIC.len())];
    if head != MAGIC {
        let show = |b: &[u8]| {
            b.iter()
                .map(|&c| if c.is_ascii_graphic() { c as char } else { '.' })
                .collect::<String>()
        };
        if head.len() < MAGIC.len() && MAGIC.starts_with(head) && !head.is_empty() {
            return Err(BundleError::NoManifest { size });
        }
        return Err(BundleError::Foreign {
            found: show(head),
            expected: show(&MAGIC),
        });
    }
    if bytes.len() < HEADER_LEN {
        return Err(BundleError::NoManifest { size });
    }
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if !(MIN_READ_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(BundleError::Version {
            found: version,
            oldest: MIN_READ_VERSION,
            supported: FORMAT_VERSION,
        });
    }
    let mut off = HEADER_LEN;
    let (h, data) = match next_frame(bytes, off, 0)? {
        Next::Frame(h, d) => (h, d),
        Next::End | Next::Truncated(_) => return Err(BundleError::NoManifest { size }),
    };
    if h.kind != K::MANIFEST && matches!(h.kind, KIND_MANIFEST | KIND_TRAFFIC_MANIFEST) {
        return Err(BundleError::WrongKind {
            found: kind_name(h.kind),
            expected: K::WHAT,
            hint: if h.kind == KIND_TRAFFIC_MANIFEST {
                ": check it against a model with `lmrr audit`"
            } else {
                ": replay it with `lmrr replay`"
            },
        });
    }
    if h.kind != K::MANIFEST {
        return Err(BundleError::Corrupt {
            frame: 0,
            offset: off as u64,
            what: format!("first frame is kind {}, expected the manifest", h.kind),
        });
    }
    let manifest = K::decode_manifest(version, &payload_bytes(&h, data, 0, off)?).map_err(|e| {
        BundleError::Corrupt {
            frame: 0,
            offset: off as u64,
            what: format!("decoding the manifest: {e}"),
        }
    })?;
    if K::format_version(&manifest) != version {
        return Err(BundleError::Corrupt {
            frame: 0,
            offset: off as u64,
            what: format!(
                "manifest says format {}, header says {version}",
                K::format_version(&manifest)
            ),
        });
    }
    off += FRAME_HEADER_LEN + h.comp_len;
    let mut frames = 1;
    let mut events = Vec::new();
    let integrity = loop {
        let index = frames;
        match next_frame(bytes, off, index)? {
            Next::End => {
                break Integrity::Truncated {
                    frames,
                    offset: off as u64,
                    why: "no trailer".into(),
                }
            }
            Next::Truncated(why) => {
                break Integrity::Truncated {
                    frames,
                    offset: off as u64,
                    why,
                }
            }
            Next::Frame(h, data) => match h.kind {
                k if k == K::EVENTS => {
                    let mut batch: Vec<K::Event> = payload(&h, data, index, off)?;
                    events.append(&mut batch);
                    off += FRAME_HEADER_LEN + h.comp_len;
                    frames += 1;
                }
                KIND_TRAILER => {
                    let t: Trailer = payload(&h, data, index, off)?;
                    let corrupt = |what: String| BundleError::Corrupt {
                        frame: index,
                        offset: off as u64,
                        what,
                    };
                    let sha: [u8; 32] = Sha256::digest(&bytes[..off]).into();
                    if sha != t.sha256 {
                        return Err(corrupt("trailer SHA-256 does not match the bundle".into()));
                    }
                    let steps = events.iter().filter(|e| K::is_step(e)).count() as u64;
                    if t.frames as usize != frames
                        || t.events != events.len() as u64
                        || t.steps != steps
                    {
                        return Err(corrupt(format!(
                            "trailer counts {} frames, {} events, {} steps; read {frames}, {}, {steps}",
                            t.frames,
                            t.events,
                            t.steps,
                            events.len()
                        )));
                    }
                    off += FRAME_HEADER_LEN + h.comp_len;
                    frames += 1;
                    if off != bytes.len() {
                        return Err(BundleError::Corrupt {
                            frame: frames,
                            offset: off as u64,
                            what: format!("{} bytes after the trailer", bytes.len() - off),
                        });
                    }
                    break Integrity::Complete { sha256: sha };
                }
                other => {
                    return Err(BundleError::Corrupt {
                        frame: index,
                        offset: off as u64,
                        what: format!("unexpected frame kind {other} after the manifest"),
                    })
                }
            },
        }
    };
    Ok(BundleOf {
        manifest,
        events,
        frames,
        size,
        integrity,
    })
}
