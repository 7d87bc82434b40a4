//! The on-disk cache of compiled CUDA modules, so that NVRTC runs once per
//! machine rather than once per process.
//!
//! Owns the cache's key, its location and its entry format; what is
//! compiled and how it is loaded belong to `compile` and `launch`, which
//! hand [`get_or_build`] a build and a load closure.
//!
//! - Key: a SHA-256 over every input that can change the compiled bytes:
//!   the exact source text NVRTC compiles (the resident module's defines
//!   included), the NVRTC options, the output format, the device's compute
//!   capability, the driver's version and NVRTC's version ([`KeyInputs`]).
//!   Nothing else is looked at, so a stale entry cannot be picked up.
//! - Location: `$LMRR_CACHE_DIR`, else `$XDG_CACHE_HOME/lmrr`, else
//!   `$HOME/.cache/lmrr`, then `cuda/<key>.cubin` (or `.ptx`).
//!   `LMRR_CUDA_CACHE=0` turns the cache off.
//! - Entry: an [`HEADER_LEN`]-byte header (magic, the key, the payload's
//!   length and its SHA-256) followed by the payload, written to a temporary
//!   file in the same folder and renamed into place, so that a reader sees a
//!   whole entry or none, even with several processes writing the same one.
//!
//! Invariant: the cache only ever saves time. A missing, unreadable,
//! truncated or corrupt entry, or one the driver refuses to load, is
//! ignored with a one-line warning and rebuilt; a folder that cannot be
//! created or written means compiling without the cache (again a warning).
//! No failure of the cache is an error of [`crate::cuda::Gpu::open`].

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::GpuError;

/// The variable that turns the cache off (`0`) or on (`1`, the default).
pub const CACHE_VAR: &str = "LMRR_CUDA_CACHE";

/// The entry format's magic; a new format takes a new magic (an old entry
/// then reads as corrupt and is rebuilt).
pub const MAGIC: &[u8; 8] = b"LMRRCM01";

/// Bytes of an entry's header: magic, key, payload length (u64, little
/// endian), payload SHA-256.
pub const HEADER_LEN: usize = 8 + 32 + 8 + 32;

/// What the driver is given: a CUBIN (machine code for one architecture,
/// loaded as is) or PTX (compiled again by the driver when loaded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Cubin,
    Ptx,
}

impl Format {
    /// The entry's file extension, also hashed into the key.
    pub fn ext(self) -> &'static str {
        match self {
            Format::Cubin => "cubin",
            Format::Ptx => "ptx",
        }
    }
}

/// Everything a compiled module depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInputs<'a> {
    /// The text NVRTC compiles, exactly.
    pub source: &'a str,
    /// NVRTC's options, in the order given to it.
    pub options: &'a [String],
    pub format: Format,
    /// The device's compute capability, `(major, minor)`.
    pub capability: (i32, i32),
    /// `cuDriverGetVersion` (e.g. 13000 for 13.0).
    pub driver: i32,
    /// `nvrtcVersion`, `(major, minor)`.
    pub nvrtc: (i32, i32),
}

/// A module's cache key: SHA-256 of its [`KeyInputs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key(pub [u8; 32]);

impl Key {
    /// The key of `inputs`. Each field is written with its length (or as a
    /// fixed-width number) so that no two different inputs hash the same
    /// byte stream.
    pub fn of(inputs: &KeyInputs<'_>) -> Self {
        let mut h = Sha256::new();
        let mut field = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        field(MAGIC);
        field(inputs.source.as_bytes());
        field(&(inputs.options.len() as u64).to_le_bytes());
        for o in inputs.options {
            field(o.as_bytes());
        }
        field(inputs.format.ext().as_bytes());
        field(&inputs.capability.0.to_le_bytes());
        field(&inputs.capability.1.to_le_bytes());
        field(&inputs.driver.to_le_bytes());
        field(&inputs.nvrtc.0.to_le_bytes());
        field(&inputs.nvrtc.1.to_le_bytes());
        Self(h.finalize().into())
    }

    /// Lower-case hex, the entry's file stem.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Why a cache entry was not used (each is a warning, then a rebuild).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {len} bytes, shorter than the {HEADER_LEN}-byte header", path.display())]
    Truncated { path: PathBuf, len: usize },
    #[error("{}: not an lmrr module cache entry (bad magic)", path.display())]
    Magic { path: PathBuf },
    #[error("{}: the header's key {found} is not the file's {wanted}", path.display())]
    Key {
        path: PathBuf,
        found: String,
        wanted: String,
    },
    #[error("{}: the header claims {claimed} payload bytes, the file holds {actual}", path.display())]
    Length {
        path: PathBuf,
        claimed: u64,
        actual: usize,
    },
    #[error("{}: the payload's SHA-256 is not the header's", path.display())]
    Checksum { path: PathBuf },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Whether the cache is on, from `LMRR_CUDA_CACHE` as `get` returns it: unset
/// or `1` on, `0` off, anything else an error naming the variable.
pub fn enabled(get: &impl Fn(&str) -> Option<String>) -> Result<bool, GpuError> {
    match get(CACHE_VAR).as_deref().map(str::trim) {
        None | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(v) => Err(GpuError::Config(format!(
            "{CACHE_VAR}={v:?}: want 0 (compile every start) or 1 (cache the compiled module)"
        ))),
    }
}

/// The cache's root folder from the variables `get` returns:
/// `$LMRR_CACHE_DIR`, else `$XDG_CACHE_HOME/lmrr` (an absolute path only,
/// as the XDG spec says), else `$HOME/.cache/lmrr`; `None` if none is set.
/// Modules live in its `cuda/` folder ([`modules_dir`]).
pub fn root_dir(get: &impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let set = |var: &str| get(var).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("LMRR_CACHE_DIR")
        .or_else(|| {
            set("XDG_CACHE_HOME")
                .filter(|p| p.is_absolute())
                .map(|p| p.join("lmrr"))
        })
        .or_else(|| set("HOME").map(|p| p.join(".cache").join("lmrr")))
}

/// The folder of compiled modules under [`root_dir`].
pub fn modules_dir(get: &impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    root_dir(get).map(|d| d.join("cuda"))
}

/// The entry of `key` in `dir`.
pub fn entry_path(dir: &Path, key: &Key, format: Format) -> PathBuf {
    dir.join(format!("{}.{}", key.hex(), format.ext()))
}

/// `payload` with its header.
fn encode(key: &Key, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&key.0);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(payload));
    out.extend_from_slice(payload);
    out
}

/// The payload of entry `bytes` (read from `path`), checked against `key`.
fn decode(path: &Path, key: &Key, mut bytes: Vec<u8>) -> Result<Vec<u8>, CacheError> {
    let path = || path.to_path_buf();
    if bytes.len() < HEADER_LEN {
        return Err(CacheError::Truncated {
            path: path(),
            len: bytes.len(),
        });
    }
    if &bytes[..8] != MAGIC {
        return Err(CacheError::Magic { path: path() });
    }
    if bytes[8..40] != key.0 {
        let mut found = [0u8; 32];
        found.copy_from_slice(&bytes[8..40]);
        return Err(CacheError::Key {
            path: path(),
            found: Key(found).hex(),
            wanted: key.hex(),
        });
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[40..48]);
    let claimed = u64::from_le_bytes(len);
    let actual = bytes.len() - HEADER_LEN;
    if claimed != actual as u64 {
        return Err(CacheError::Length {
            path: path(),
            claimed,
            actual,
        });
    }
    if Sha256::digest(&bytes[HEADER_LEN..])[..] != bytes[48..HEADER_LEN] {
        return Err(CacheError::Checksum { path: path() });
    }
    Ok(bytes.split_off(HEADER_LEN))
}

/// Reads the entry at `path`: `Ok(None)` if there is none, its payload if
/// it is whole and is `key`'s, an error saying what is wrong otherwise.
pub fn read_entry(path: &Path, key: &Key) -> Result<Option<Vec<u8>>, CacheError> {
    match std::fs::read(path) {
        Ok(bytes) => decode(path, key, bytes).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

/// Writes `payload` as `key`'s entry at `path`: to a temporary file in the
/// same folder (named for this process and a counter, so that concurrent
/// writers never share one), flushed, then renamed over `path`.
pub fn write_entry(path: &Path, key: &Key, payload: &[u8]) -> Result<(), CacheError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        key.hex(),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&encode(key, payload))?;
        f.sync_all()
    })();
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path)(e));
    }
    Ok(())
}

/// The cache as this process uses it: the folder of module entries, or none
/// (off, no home, or a folder that could not be created).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleCache {
    pub dir: Option<PathBuf>,
    /// Why there is no folder, for the "compiling" line.
    pub off_because: Option<String>,
}

impl ModuleCache {
    /// The cache from the process environment.
    pub fn from_env() -> Result<Self, GpuError> {
        Self::from_vars(&|var| std::env::var(var).ok())
    }

    /// The cache from the variables `get` returns, its folder created. A
    /// bad `LMRR_CUDA_CACHE` is an error; a folder that cannot be created
    /// is a warning and no cache.
    pub fn from_vars(get: &impl Fn(&str) -> Option<String>) -> Result<Self, GpuError> {
        if !enabled(get)? {
            return Ok(Self::off(format!("{CACHE_VAR}=0")));
        }
        let Some(dir) = modules_dir(get) else {
            return Ok(Self::off(
                "no LMRR_CACHE_DIR, XDG_CACHE_HOME or HOME".to_string(),
            ));
        };
        if let Err(e) = std::fs::create_dir_all(&dir) {
            warn(&format!(
                "cannot create the CUDA module cache {}: {e}; compiling without it",
                dir.display()
            ));
            return Ok(Self::off(format!("{} could not be created", dir.display())));
        }
        Ok(Self {
            dir: Some(dir),
            off_because: None,
        })
    }

    fn off(why: String) -> Self {
        Self {
            dir: None,
            off_because: Some(why),
        }
    }
}

/// One line on stderr, prefixed as the binary's messages are.
pub fn warn(line: &str) {
    eprintln!("lmrr: {line}");
}

/// `load` of `key`'s module: from its cache entry if there is a whole one
/// the loader accepts, else from `build` (announced on stderr with `what`,
/// e.g. "the CUDA kernels for sm_90"), whose bytes are then stored. Every
/// failure of the cache is a warning and a rebuild; only `build`'s error,
/// or `load`'s on freshly built bytes, is returned.
pub fn get_or_build<T>(
    cache: &ModuleCache,
    key: &Key,
    format: Format,
    what: &str,
    build: impl FnOnce() -> Result<Vec<u8>, GpuError>,
    mut load: impl FnMut(&[u8]) -> Result<T, GpuError>,
) -> Result<T, GpuError> {
    let path = cache.dir.as_deref().map(|d| entry_path(d, key, format));
    if let Some(path) = &path {
        match read_entry(path, key) {
            Ok(Some(payload)) => match load(&payload) {
                Ok(t) => return Ok(t),
                Err(e) => warn(&format!(
                    "the driver refused the cached module {} ({e}); rebuilding it",
                    path.display()
                )),
            },
            Ok(None) => {}
            Err(e) => warn(&format!("ignoring a bad cached module: {e}; rebuilding it")),
        }
    }
    match (&path, &cache.off_because) {
        (Some(p), _) => warn(&format!(
            "compiling {what} (once; cached in {})",
            p.parent().unwrap_or(p).display()
        )),
        (None, Some(why)) => warn(&format!("compiling {what} (not cached: {why})")),
        (None, None) => warn(&format!("compiling {what}")),
    }
    let payload = build()?;
    if let Some(path) = &path {
        if let Err(e) = write_entry(path, key, &payload) {
            warn(&format!("could not store the compiled module: {e}"));
        }
    }
    load(&payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn inputs<'a>(source: &'a str, options: &'a [String]) -> KeyInputs<'a> {
        KeyInputs {
            source,
            options,
            format: Format::Cubin,
            capability: (9, 0),
            driver: 13000,
            nvrtc: (13, 0),
        }
    }

    /// A fresh folder under the target's temp dir, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let d =
                std::env::temp_dir().join(format!("lmrr-cache-test-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
            Self(d)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn vars<'a>(list: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            list.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_key_changes_with_every_input_and_only_then() {
        let opts = vec![
            "--fmad=false".to_string(),
            "--gpu-architecture=sm_90".into(),
        ];
        let base = Key::of(&inputs("kernel", &opts));
        assert_eq!(base, Key::of(&inputs("kernel", &opts.clone())));
        assert_eq!(base.hex().len(), 64);
        let other_opts = vec!["--fmad=true".to_string(), "--gpu-architecture=sm_90".into()];
        let fewer = vec!["--fmad=false".to_string()];
        // Options split differently hash differently ("a","bc" vs "ab","c").
        let (ab, c) = (
            vec!["ab".to_string(), "c".into()],
            vec!["a".into(), "bc".into()],
        );
        let mut changed = vec![
            Key::of(&inputs("kernel ", &opts)),
            Key::of(&inputs("kernel", &other_opts)),
            Key::of(&inputs("kernel", &fewer)),
            Key::of(&inputs("kernel", &ab)),
            Key::of(&inputs("kernel", &c)),
        ];
        let edits: [fn(&mut KeyInputs<'_>); 6] = [
            |k| k.format = Format::Ptx,
            |k| k.capability = (9, 1),
            |k| k.capability = (10, 0),
            |k| k.driver = 13010,
            |k| k.nvrtc = (13, 1),
            |k| k.nvrtc = (12, 0),
        ];
        for f in edits {
            let mut k = inputs("kernel", &opts);
            f(&mut k);
            changed.push(Key::of(&k));
        }
        let mut all = changed.clone();
        all.push(base);
        let distinct: std::collections::HashSet<_> = all.iter().map(|k| k.0).collect();
        assert_eq!(distinct.len(), all.len(), "two inputs share a key");
    }

    #[test]
    fn the_folder_follows_lmrr_cache_dir_then_xdg_then_home() {
        let all = [
            ("LMRR_CACHE_DIR", "/c/lmrr"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ];
        assert_eq!(
            modules_dir(&vars(&all)),
            Some(PathBuf::from("/c/lmrr/cuda"))
        );
        assert_eq!(
            modules_dir(&vars(&all[1..])),
            Some(PathBuf::from("/x/lmrr/cuda"))
        );
        assert_eq!(
            modules_dir(&vars(&all[2..])),
            Some(PathBuf::from("/h/.cache/lmrr/cuda"))
        );
        // Empty values are unset; a relative XDG_CACHE_HOME is ignored.
        let empty = [
            ("LMRR_CACHE_DIR", ""),
            ("XDG_CACHE_HOME", "rel"),
            ("HOME", "/h"),
        ];
        assert_eq!(
            modules_dir(&vars(&empty)),
            Some(PathBuf::from("/h/.cache/lmrr/cuda"))
        );
        assert_eq!(modules_dir(&vars(&[])), None);
    }

    #[test]
    fn lmrr_cuda_cache_turns_it_off_and_a_bad_value_names_it() {
        let d = TempDir::new("off");
        let root = d.0.to_string_lossy().into_owned();
        let on = ModuleCache::from_vars(&vars(&[("LMRR_CACHE_DIR", &root)]))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(on.dir, Some(d.0.join("cuda")));
        assert!(d.0.join("cuda").is_dir());
        let off = ModuleCache::from_vars(&vars(&[("LMRR_CACHE_DIR", &root), (CACHE_VAR, "0")]))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(off.dir, None);
        match ModuleCache::from_vars(&vars(&[(CACHE_VAR, "yes")])) {
            Err(GpuError::Config(m)) => assert!(m.contains(CACHE_VAR) && m.contains("yes"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_folder_that_cannot_be_created_means_no_cache() {
        let d = TempDir::new("blocked");
        // A file where the folder would go.
        let file = d.0.join("file");
        std::fs::write(&file, b"x").unwrap_or_else(|e| panic!("{e}"));
        let root = file.to_string_lossy().into_owned();
        let c = ModuleCache::from_vars(&vars(&[("LMRR_CACHE_DIR", &root)]))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.dir, None);
        let built = get_or_build(
            &c,
            &Key([1; 32]),
            Format::Cubin,
            "t",
            || Ok(vec![7]),
            |b| Ok(b.to_vec()),
        );
        assert_eq!(built.ok(), Some(vec![7]));
    }

    #[test]
    fn an_entry_written_is_read_back_and_leaves_no_temporary_file() {
        let d = TempDir::new("roundtrip");
        let key = Key([3; 32]);
        let path = entry_path(&d.0, &key, Format::Cubin);
        assert!(matches!(read_entry(&path, &key), Ok(None)));
        let payload: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        write_entry(&path, &key, &payload).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            read_entry(&path, &key).unwrap_or_else(|e| panic!("{e}")),
            Some(payload.clone())
        );
        // Rewriting replaces it whole.
        write_entry(&path, &key, b"short").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            read_entry(&path, &key).ok().flatten(),
            Some(b"short".to_vec())
        );
        let names: Vec<_> = std::fs::read_dir(&d.0)
            .unwrap_or_else(|e| panic!("{e}"))
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn a_damaged_entry_is_named_for_what_is_wrong() {
        let d = TempDir::new("damaged");
        let key = Key([5; 32]);
        let path = entry_path(&d.0, &key, Format::Ptx);
        let good = encode(&key, b"payload bytes");
        let check = |bytes: Vec<u8>| {
            std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("{e}"));
            read_entry(&path, &key)
        };
        assert!(matches!(
            check(good[..20].to_vec()),
            Err(CacheError::Truncated { len: 20, .. })
        ));
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert!(matches!(check(bad), Err(CacheError::Magic { .. })));
        assert!(matches!(
            check(encode(&Key([6; 32]), b"payload bytes")),
            Err(CacheError::Key { .. })
        ));
        assert!(matches!(
            check(good[..good.len() - 1].to_vec()),
            Err(CacheError::Length {
                claimed: 13,
                actual: 12,
                ..
            })
        ));
        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x80;
        match check(flipped) {
            Err(e @ CacheError::Checksum { .. }) => {
                assert!(e.to_string().contains(&*path.to_string_lossy()), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(check(good).ok().flatten(), Some(b"payload bytes".to_vec()));
    }

    #[test]
    fn a_corrupt_or_refused_entry_is_rebuilt_and_a_good_one_is_not() {
        let d = TempDir::new("rebuild");
        let cache = ModuleCache {
            dir: Some(d.0.clone()),
            off_because: None,
        };
        let key = Key([9; 32]);
        let path = entry_path(&d.0, &key, Format::Cubin);
        let builds = Cell::new(0);
        let build = |bytes: &'static [u8]| {
            let builds = &builds;
            move || {
                builds.set(builds.get() + 1);
                Ok(bytes.to_vec())
            }
        };
        let accept = |b: &[u8]| Ok(b.to_vec());
        // Missing: built and stored.
        let got = get_or_build(&cache, &key, Format::Cubin, "t", build(b"v1"), accept);
        assert_eq!((got.ok(), builds.get()), (Some(b"v1".to_vec()), 1));
        // Present: loaded, not built.
        let got = get_or_build(&cache, &key, Format::Cubin, "t", build(b"v2"), accept);
        assert_eq!((got.ok(), builds.get()), (Some(b"v1".to_vec()), 1));
        // Corrupt (a payload byte flipped): rebuilt and replaced.
        let mut bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("{e}"));
        let got = get_or_build(&cache, &key, Format::Cubin, "t", build(b"v3"), accept);
        assert_eq!((got.ok(), builds.get()), (Some(b"v3".to_vec()), 2));
        assert_eq!(read_entry(&path, &key).ok().flatten(), Some(b"v3".to_vec()));
        // Whole but refused by the loader: rebuilt; the fresh bytes load.
        let got = get_or_build(&cache, &key, Format::Cubin, "t", build(b"v4"), |b| {
            if b == b"v3" {
                Err(GpuError::Driver("CUDA_ERROR_INVALID_IMAGE".into()))
            } else {
                Ok(b.to_vec())
            }
        });
        assert_eq!((got.ok(), builds.get()), (Some(b"v4".to_vec()), 3));
        // A build error is returned as is.
        let _ = std::fs::remove_file(&path);
        let got: Result<Vec<u8>, _> = get_or_build(
            &cache,
            &key,
            Format::Cubin,
            "t",
            || Err(GpuError::Compile("bad".into())),
            accept,
        );
        assert!(matches!(got, Err(GpuError::Compile(_))));
    }
}
