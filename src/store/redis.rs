//! [`RedisStore`]: the shared store tier on Redis (a single node or Redis Cluster),
//! through the `redis` crate's sync client (feature `redis`).
//!
//! # Keys and values
//!
//! A page lives under `{namespace}:{model_id}:{page hash as 64 hex digits}`, or
//! `{namespace}:{model_id}:{salt digest}:{page hash}` with a
//! [`salt`](RedisStoreConfig::salt) (32 hex digits of a SHA-256 of the salt: tenants of
//! different salts keep their own copies of a page instead of overwriting each other's,
//! and the salt itself is not shown). There is no hash tag, so a Redis Cluster spreads a
//! request's pages over its slots and nodes. A value is a [`PageHeader`] and the page's
//! bytes in page-first order (see [`super`]), bound to the store's namespace, model id,
//! salt and format and to the page hash ([`PageBinding`]): a value copied, restored or
//! written under another key is refused ([`Invalid::Foreign`], counted in
//! [`StoreStats::foreign`]).
//!
//! With a [`mac_key`](RedisStoreConfig::mac_key) values are sealed with HMAC-SHA-256
//! instead of CRC-32, and only values whose MAC verifies under the key load: a value
//! without a MAC ([`Invalid::NoMac`]) or with another one ([`Invalid::Mac`]) is
//! counted in [`StoreStats::forged`]. A store without a key refuses values sealed with
//! a MAC ([`Invalid::Keyed`]); so every client of a deployment's pages needs the same
//! key, or none.
//!
//! The namespace and the model id are percent-escaped in the key: `%` is `%25`, `:` is
//! `%3A`, `{` is `%7B` and `}` is `%7D` (uppercase hex digits); every other byte is
//! itself. Neither part then holds a `:`, so the key splits back into exactly one
//! (namespace, model id, hash): two configurations whose parts differ never share a key
//! (namespace `a:b` with model `c` is `a%3Ab:c:...`, namespace `a` with model `b:c` is
//! `a:b%3Ac:...`), and no part can make a hash tag. Names without those four
//! characters read as they are (`kvpool:llama-3-8b:0f3a...`).
//!
//! Writes are plain `SET`s: pages are content-addressed, so a second writer of a page
//! writes the same bytes. A `SET` replaces a key of any type, so a page written over a
//! key that held something else (a list, say) repairs it. Give the server a `maxmemory`
//! and an evicting policy (`maxmemory-policy allkeys-lru`) to use it as a cache; with
//! `noeviction` a full server refuses writes ([`StoreError::Full`]) and the client
//! backs its writes off.
//!
//! # Batches
//!
//! Every operation is one pipeline: `EXISTS` per page for
//! [`exists_prefix`](PageStore::exists_prefix), `GET` per page for
//! [`get`](PageStore::get), `SET` per page for [`put`](PageStore::put). On a single node
//! the pipeline goes out as one write and the replies come back in order; in cluster
//! mode the `redis` crate's cluster pipeline groups the commands by the node that owns
//! each key's slot, sends each node its part and puts the replies back in order. A
//! value is serialized straight into the command buffer (header, then the page's pieces:
//! no staging copy of the page, in either host layout).
//!
//! # Timeouts, backoff, reconnection
//!
//! * Single node: the client owns its TCP stream, and
//!   [`timeout`](RedisStoreConfig::timeout) is a deadline for the whole operation
//!   (every socket read and write waits at most for what is left of it); at the deadline
//!   the operation fails with [`StoreError::Timeout`] and the connection is dropped.
//!   Replies to [`get`](PageStore::get) are read by the store's own RESP2/RESP3
//!   reader: each value goes straight from the socket into a staging buffer owned by
//!   the connection (one slot per page of the batch, grown to the largest batch read
//!   and reused: no allocation per reply; 128 MiB after a batch of 64 2 MiB pages,
//!   freed with the connection, e.g. by [`disconnect`](RedisStore::disconnect)), is
//!   checked there as it arrives, and the leading sound run is copied into the
//!   caller's pages once every reply was read (a failed operation writes nothing). A
//!   reply that is neither a bulk string, a nil nor an error is a protocol error and
//!   drops the connection. Other commands are encoded and their replies parsed by the
//!   `redis` crate (`Pipeline`, `Parser`), through the same read buffer.
//! * Cluster: the `redis` crate's cluster connection, with
//!   [`timeout`](RedisStoreConfig::timeout) as its response timeout (each reply waits at
//!   most that long) and [`connect_timeout`](RedisStoreConfig::connect_timeout) per
//!   node; it follows `MOVED`/`ASK` redirections itself (two retries at most).
//! * An error reply for one key of a batch (`WRONGTYPE` for a key that holds a list,
//!   `NOPERM` for a key an ACL denies, any other) concerns that key only: it is a miss
//!   for that page in [`get`](PageStore::get) ([`Miss::Error`]), an absent page in
//!   [`exists_prefix`](PageStore::exists_prefix) (the prefix stops there), and a page not
//!   written in [`put`](PageStore::put) (which writes the others and then fails with
//!   [`StoreError::Server`]); each is counted in [`StoreStats::key_errors`]. Neither such
//!   a reply nor any other error reply (to a command of
//!   [`with_connection`](RedisStore::with_connection)) drops the connection or starts a
//!   backoff: one bad key cannot take the tier down.
//! * After a connection-level failure (connection refused or broken, timeout, a reply
//!   the protocol does not allow) the client backs off ([`BackoffConfig`]: exponential,
//!   capped): operations return [`StoreError::Unavailable`] at once, without touching
//!   the network or waiting for the connection's lock. The first operation after the
//!   wait connects again (a reconnect, counted in [`StoreStats::reconnects`]); its
//!   success clears the backoff. A full server (an `OOM` reply to a write:
//!   [`StoreError::Full`]) backs off writes only.
//!
//! One connection serves all threads (operations on one store are serialized by a
//! mutex); open more stores for more parallel connections.
//!
//! # Examples
//!
//! ```no_run
//! use std::time::Duration;
//! use kvpool::store::redis::{RedisStore, RedisStoreConfig};
//! use kvpool::store::{BackoffConfig, PageFormat, PageStore};
//!
//! let format = PageFormat { page_size: 16, bytes_per_token: 131072 };   // 2 MiB pages
//! let mut cfg = RedisStoreConfig::cluster(
//!     ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000", "redis://10.0.0.3:7000"],
//!     "llama-3-8b", format);
//! cfg.namespace = "prod".into();
//! cfg.timeout = Duration::from_millis(500);
//! cfg.backoff = BackoffConfig { initial: Duration::from_millis(20), max: Duration::from_secs(2) };
//! let store = RedisStore::new(cfg)?;
//! let page = vec![0u8; format.page_bytes()];
//! store.put(&[[1; 32]], &[&page])?;
//! # Ok::<(), kvpool::store::StoreError>(())
//! ```

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConnection};
use redis::{
    Cmd, ConnectionAddr, ConnectionInfo, ConnectionLike, ErrorKind, IntoConnectionInfo, RedisError, RedisResult,
    RedisWrite, ToRedisArgs, Value,
};

use super::health::{Backoff, BackoffConfig, Counters};
use super::{
    check_page, Invalid, Loaded, MacKey, Miss, PageBinding, PageFormat, PageHeader, PageStore, StoreError, StoreStats,
    HEADER_BYTES,
};
use crate::kv::host::HostKvPool;
use crate::radix::BlockHash;

/// Where a [`RedisStore`] connects and how it behaves. Its [`Debug`](core::fmt::Debug)
/// output shows neither the salt nor the MAC key, only their lengths.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisStoreConfig {
    /// `redis://[user:password@]host:port[/db]` URLs: one for a single node; for a
    /// cluster, any of its nodes (the rest are discovered).
    pub nodes: Vec<String>,
    /// Whether `nodes` are a Redis Cluster.
    pub cluster: bool,
    /// The first part of every key (one store for several deployments). Any text:
    /// escaped in the key (see the [module docs](self#keys-and-values)).
    pub namespace: String,
    /// The model (and anything else that changes the KV bytes: weights, dtype, TP rank)
    /// whose pages these are; the second part of every key. Any text: escaped in the key.
    pub model_id: String,
    /// A salt every value is bound to, e.g. a tenant's cache salt: values written under
    /// one salt are misses under any other ([`Invalid::Foreign`]). Any text; empty (the
    /// default) adds nothing to the key, any other salt adds its digest (see the
    /// [module docs](self#keys-and-values)).
    pub salt: String,
    /// The secret of the values' MAC (HMAC-SHA-256; default none: CRC-32). With one,
    /// only values written with the same key load; without one, values sealed with a
    /// MAC are refused. See the [module docs](self#keys-and-values).
    pub mac_key: Option<MacKey>,
    /// The pages' format; values of another format are misses.
    pub format: PageFormat,
    /// Deadline of one operation (single node), or of one reply (cluster).
    pub timeout: Duration,
    /// Deadline of making a connection.
    pub connect_timeout: Duration,
    /// The wait after failures.
    pub backoff: BackoffConfig,
}

impl RedisStoreConfig {
    /// A single node at `url`, namespace `kvpool`, timeout 2 s, connect timeout 500 ms,
    /// the default backoff.
    pub fn new(url: impl Into<String>, model_id: impl Into<String>, format: PageFormat) -> RedisStoreConfig {
        RedisStoreConfig {
            nodes: vec![url.into()],
            cluster: false,
            namespace: "kvpool".into(),
            model_id: model_id.into(),
            salt: String::new(),
            mac_key: None,
            format,
            timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_millis(500),
            backoff: BackoffConfig::default(),
        }
    }

    /// A Redis Cluster reached through `nodes`, otherwise as [`new`](Self::new).
    pub fn cluster<S: Into<String>>(
        nodes: impl IntoIterator<Item = S>,
        model_id: impl Into<String>,
        format: PageFormat,
    ) -> RedisStoreConfig {
        let mut cfg = RedisStoreConfig::new(String::new(), model_id, format);
        cfg.nodes = nodes.into_iter().map(Into::into).collect();
        cfg.cluster = true;
        cfg
    }
}

impl core::fmt::Debug for RedisStoreConfig {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("RedisStoreConfig")
            .field("nodes", &self.nodes)
            .field("cluster", &self.cluster)
            .field("namespace", &self.namespace)
            .field("model_id", &self.model_id)
            .field("salt", &format_args!("({} bytes)", self.salt.len()))
            .field("mac_key", &self.mac_key)
            .field("format", &self.format)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("backoff", &self.backoff)
            .finish()
    }
}

/// `{namespace}:{model_id}:` with `%`, `:`, `{` and `}` of each part percent-escaped
/// (`%25`, `%3A`, `%7B`, `%7D`): no escaped part holds a `:`, and the escaping decodes
/// uniquely, so distinct (namespace, model id) pairs give distinct prefixes, and the
/// prefix holds no hash tag. The four are ASCII, so no UTF-8 sequence is split. A
/// non-empty salt adds `{salt digest}:` (32 lowercase hex digits, no `:`: a salted
/// prefix has one more part than any unsalted one).
fn key_prefix(namespace: &str, model_id: &str, salt: &str) -> Vec<u8> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = Vec::with_capacity(namespace.len() + model_id.len() + 35);
    for part in [namespace, model_id] {
        for &b in part.as_bytes() {
            match b {
                b'%' | b':' | b'{' | b'}' => {
                    out.extend_from_slice(&[b'%', HEX[(b >> 4) as usize], HEX[(b & 15) as usize]])
                }
                _ => out.push(b),
            }
        }
        out.push(b':');
    }
    if !salt.is_empty() {
        use sha2::{Digest, Sha256};
        let digest = Sha256::new().chain_update(b"kvpool key salt\0").chain_update(salt).finalize();
        for b in &digest[..16] {
            let _ = write!(out, "{b:02x}");
        }
        out.push(b':');
    }
    out
}

/// The shared store tier on Redis (see the [module docs](self)).
pub struct RedisStore {
    cfg: RedisStoreConfig,
    /// `{namespace}:{model_id}:` (and the salt's digest), both parts escaped
    /// ([`key_prefix`]).
    prefix: Vec<u8>,
    /// What every value is bound to and sealed with.
    binding: PageBinding,
    target: Target,
    link: Mutex<Link>,
    backoff: Backoff,
    write_backoff: Backoff,
    counters: Counters,
}

impl core::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("RedisStore").field("config", &self.cfg).field("stats", &self.stats()).finish()
    }
}

enum Target {
    Single(ConnectionInfo),
    Cluster(ClusterClient),
}

struct Link {
    conn: Option<Conn>,
    connected_before: bool,
}

enum Conn {
    Single(TcpConn),
    Cluster(Box<ClusterConnection>),
}

impl RedisStore {
    /// A store client for `cfg`. Connects lazily: the first operation connects, so a
    /// store that is down at start-up is not an error here.
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for no nodes, a URL that is not `redis://` over TCP, a
    /// zero timeout or backoff, or a page format of no bytes (or too many for memory).
    /// (A [`MacKey`] too short is refused where it is made.)
    pub fn new(cfg: RedisStoreConfig) -> Result<RedisStore, StoreError> {
        let config = |detail: String| StoreError::Config { detail };
        if cfg.nodes.is_empty() {
            return Err(config("no nodes".into()));
        }
        if cfg.timeout.is_zero() || cfg.connect_timeout.is_zero() {
            return Err(config("timeouts must be positive".into()));
        }
        if cfg.backoff.initial.is_zero() || cfg.backoff.max < cfg.backoff.initial {
            return Err(config("backoff must be positive, its max at least its initial wait".into()));
        }
        let bytes = (cfg.format.page_size as u64).checked_mul(cfg.format.bytes_per_token);
        if bytes.map_or(true, |b| b == 0 || b > (isize::MAX as u64) - HEADER_BYTES as u64) {
            return Err(config(format!("page format {:?} has no bytes or too many", cfg.format)));
        }
        let infos = cfg
            .nodes
            .iter()
            .map(|n| n.as_str().into_connection_info().map_err(|e| config(format!("`{n}`: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(n) = infos.iter().position(|i| !matches!(i.addr(), ConnectionAddr::Tcp(..))) {
            return Err(config(format!("`{}` is not a redis:// TCP address", cfg.nodes[n])));
        }
        let target = if cfg.cluster {
            let client = ClusterClientBuilder::new(infos)
                .connection_timeout(cfg.connect_timeout)
                .response_timeout(cfg.timeout)
                .retries(2)
                .min_retry_wait(10)
                .max_retry_wait(200)
                .build()
                .map_err(|e| config(e.to_string()))?;
            Target::Cluster(client)
        } else {
            if infos.len() != 1 {
                return Err(config(format!("{} nodes for a single-node store", infos.len())));
            }
            Target::Single(infos.into_iter().next().expect("one node"))
        };
        let prefix = key_prefix(&cfg.namespace, &cfg.model_id, &cfg.salt);
        let mut binding = PageBinding::new(&cfg.namespace, &cfg.model_id, &cfg.salt, cfg.format);
        if let Some(key) = &cfg.mac_key {
            binding = binding.with_mac(key);
        }
        Ok(RedisStore {
            binding,
            backoff: Backoff::new(cfg.backoff),
            write_backoff: Backoff::new(cfg.backoff),
            cfg,
            prefix,
            target,
            link: Mutex::new(Link { conn: None, connected_before: false }),
            counters: Counters::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RedisStoreConfig {
        &self.cfg
    }

    /// The key page `hash` is stored under: `{namespace}:{model_id}:{hash as 64
    /// lowercase hex digits}` (with the salt's digest before the hash when there is a
    /// salt), the namespace and model id escaped as the
    /// [module docs](self#keys-and-values) say.
    pub fn key(&self, hash: &BlockHash) -> Vec<u8> {
        let mut key = Vec::with_capacity(self.prefix.len() + 64);
        self.write_key(hash, &mut key);
        key
    }

    /// What the store's values are bound to and sealed with (its namespace, model id,
    /// salt, format and MAC key): [`check_page`] with it is the check every read makes.
    pub fn binding(&self) -> &PageBinding {
        &self.binding
    }

    fn write_key(&self, hash: &BlockHash, key: &mut Vec<u8>) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        key.clear();
        key.extend_from_slice(&self.prefix);
        for b in hash {
            key.push(HEX[(b >> 4) as usize]);
            key.push(HEX[(b & 15) as usize]);
        }
    }

    /// Run `f` on the store's own connection, with the store's timeout, backoff and
    /// reconnection: for commands the trait does not cover (tools, tests, the raw
    /// baseline of `benches/store.rs`). On a single node `f` gets the client's deadline
    /// connection, in cluster mode the `redis` crate's `ClusterConnection`.
    ///
    /// # Errors
    ///
    /// What `f` returns, classified as the store's operations are (an error reply is
    /// [`StoreError::Server`], and starts no backoff); or [`StoreError::Unavailable`]
    /// while backing off, a connection error.
    pub fn with_connection<T>(
        &self,
        f: impl FnOnce(&mut dyn ConnectionLike) -> RedisResult<T>,
    ) -> Result<T, StoreError> {
        self.op(false, |conn| match conn {
            Conn::Single(c) => f(c),
            Conn::Cluster(c) => f(&mut **c),
        })
    }

    /// Drop the connection (the next operation connects again). For tests and for
    /// operators who moved the store.
    pub fn disconnect(&self) {
        self.lock().conn = None;
    }

    fn lock(&self) -> MutexGuard<'_, Link> {
        // A panic while the lock was held (there is none in this module) leaves at
        // worst a connection in an unknown state: drop it and carry on.
        self.link.lock().unwrap_or_else(|poisoned| {
            let mut link = poisoned.into_inner();
            link.conn = None;
            link
        })
    }

    fn connect(&self) -> Result<Conn, StoreError> {
        match &self.target {
            Target::Single(info) => {
                TcpConn::connect(info, self.cfg.connect_timeout, self.cfg.timeout).map(Conn::Single)
            }
            Target::Cluster(client) => {
                client.get_connection().map(|c| Conn::Cluster(Box::new(c))).map_err(|e| self.classify(&e, false).0)
            }
        }
    }

    /// Map a `redis` error to ours; whether the connection must be dropped.
    fn classify(&self, e: &RedisError, timed_out: bool) -> (StoreError, bool) {
        if timed_out || e.is_timeout() {
            return (StoreError::Timeout { after: self.cfg.timeout }, true);
        }
        let detail = e.to_string();
        // A pipeline's error carries every command's server error; one `OOM` (a write
        // refused under `maxmemory`) means full.
        let oom = e.code() == Some("OOM")
            || e.clone().into_server_errors().is_some_and(|errs| errs.iter().any(|(_, s)| s.code() == "OOM"));
        if oom {
            return (StoreError::Full { detail }, false);
        }
        match e.kind() {
            ErrorKind::Server(_) | ErrorKind::Extension if !e.is_cluster_error() => {
                (StoreError::Server { detail }, false)
            }
            ErrorKind::UnexpectedReturnType => (StoreError::Server { detail }, false),
            _ => (StoreError::Connection { detail }, true),
        }
    }

    /// One operation: backoff check, lock, (re)connect, arm the deadline, run `f`,
    /// classify and count.
    fn op<T>(&self, write: bool, f: impl FnOnce(&mut Conn) -> RedisResult<T>) -> Result<T, StoreError> {
        self.op_then(write, f, |_, v| Ok(v))
    }

    /// [`op`](Self::op), then `then` on `f`'s result with the connection still locked
    /// (after the operation was counted and its latency sampled: `then` is local work,
    /// such as copying out of the connection's staging buffer).
    fn op_then<T, U>(
        &self,
        write: bool,
        f: impl FnOnce(&mut Conn) -> RedisResult<T>,
        then: impl FnOnce(&mut Conn, T) -> Result<U, StoreError>,
    ) -> Result<U, StoreError> {
        let c = &self.counters;
        for backoff in [Some(&self.backoff), write.then_some(&self.write_backoff)].into_iter().flatten() {
            if let Err((retry_in, failures)) = backoff.check() {
                Counters::add(&c.unavailable, 1);
                return Err(StoreError::Unavailable { retry_in, failures });
            }
        }
        let mut link = self.lock();
        let start = Instant::now();
        Counters::add(&c.ops, 1);
        if link.conn.is_none() {
            match self.connect() {
                Ok(conn) => {
                    Counters::add(&c.connects, 1);
                    if link.connected_before {
                        Counters::add(&c.reconnects, 1);
                    }
                    link.connected_before = true;
                    link.conn = Some(conn);
                }
                Err(e) => return Err(self.failed(e, start)),
            }
        }
        let conn = link.conn.as_mut().expect("connected above");
        if let Conn::Single(tcp) = conn {
            tcp.arm(self.cfg.timeout);
        }
        let result = f(conn);
        match result {
            Ok(v) => {
                c.sample(start.elapsed());
                self.backoff.succeeded();
                if write {
                    self.write_backoff.succeeded();
                }
                then(conn, v)
            }
            Err(e) => {
                let timed_out = matches!(conn, Conn::Single(tcp) if tcp.reader.stream.timed_out);
                let (err, drop) = self.classify(&e, timed_out);
                if drop {
                    link.conn = None;
                }
                Err(self.failed(err, start))
            }
        }
    }

    fn failed(&self, err: StoreError, start: Instant) -> StoreError {
        let c = &self.counters;
        Counters::add(&c.failures, 1);
        match err {
            StoreError::Timeout { .. } => Counters::add(&c.timeouts, 1),
            StoreError::Full { .. } => Counters::add(&c.full, 1),
            _ => {}
        }
        match err {
            StoreError::Full { .. } => {
                self.write_backoff.failed();
            }
            // An error reply (or an unexpected one): the server answered and the
            // connection is in step. Backing off would refuse every key for one.
            StoreError::Server { .. } => {}
            _ => {
                self.backoff.failed();
            }
        }
        self.counters.sample(start.elapsed());
        err
    }

    /// Run `cmds` as one pipeline; one reply per command, an error reply as a
    /// `Value::ServerError` in its place (not an error of the whole pipeline).
    ///
    /// In cluster mode the `redis` crate's pipeline fails whole when any command got an
    /// error reply, naming those commands (every command was sent and answered): they
    /// get their error, and the others are sent again when `again` (their replies are
    /// needed; each pass takes out the commands that got an error, so it ends), else
    /// taken as done (`OK`: the `SET`s that got no error were carried out).
    fn pipeline(&self, conn: &mut Conn, cmds: Vec<Cmd>, again: bool) -> RedisResult<Vec<Value>> {
        use redis::cluster::ClusterPipeline;
        let c = match conn {
            Conn::Single(c) => {
                let mut p = redis::pipe();
                cmds.into_iter().for_each(|cmd| {
                    p.add_command(cmd);
                });
                return p.ignore_errors().query(c);
            }
            Conn::Cluster(c) => c,
        };
        // The commands that got an error reply in one pass, by their index in it.
        let refused = |e: RedisError| match e.clone().into_server_errors() {
            Some(errors) if !errors.is_empty() => Ok(errors),
            _ => Err(e),
        };
        let mut out: Vec<Option<Value>> = vec![None; cmds.len()];
        if !again {
            let mut p = ClusterPipeline::with_capacity(cmds.len());
            cmds.into_iter().for_each(|cmd| {
                p.add_command(cmd);
            });
            return match p.query::<Vec<Value>>(c) {
                Ok(values) => Ok(values),
                Err(e) => {
                    for (k, err) in refused(e)?.iter() {
                        out[*k] = Some(Value::ServerError(err.clone()));
                    }
                    Ok(out.into_iter().map(|v| v.unwrap_or(Value::Okay)).collect())
                }
            };
        }
        let mut pending: Vec<usize> = (0..cmds.len()).collect();
        while !pending.is_empty() {
            let mut p = ClusterPipeline::with_capacity(pending.len());
            for &i in &pending {
                p.add_command(cmds[i].clone());
            }
            match p.query::<Vec<Value>>(c) {
                Ok(values) => {
                    for (&i, v) in pending.iter().zip(values) {
                        out[i] = Some(v);
                    }
                    break;
                }
                Err(e) => {
                    for (k, err) in refused(e)?.iter() {
                        out[pending[*k]] = Some(Value::ServerError(err.clone()));
                    }
                    pending.retain(|&i| out[i].is_none());
                }
            }
        }
        Ok(out.into_iter().map(|v| v.unwrap_or(Value::Nil)).collect())
    }

    fn keyed(&self, name: &str, hashes: &[BlockHash], key: &mut Vec<u8>) -> Vec<Cmd> {
        hashes
            .iter()
            .map(|h| {
                self.write_key(h, key);
                let mut cmd = redis::cmd(name);
                cmd.arg(&key[..]);
                cmd
            })
            .collect()
    }

    fn check_lists(hashes: &[BlockHash], pages: usize) -> Result<(), StoreError> {
        if pages != hashes.len() {
            return Err(StoreError::Shape { what: "pages", got: pages, expected: hashes.len() });
        }
        Ok(())
    }

    fn check_pool(&self, pool: &HostKvPool, host_pages: &[u32]) -> Result<(), StoreError> {
        let format = PageFormat::of(pool.config());
        if format != self.cfg.format {
            return Err(StoreError::Format { store: self.cfg.format, pool: format });
        }
        host_pages.iter().try_for_each(|&p| pool.check_page(p)).map_err(StoreError::Host)
    }

    /// `SET` every page; `chunks(i)` yields page `i`'s bytes in page-first order.
    fn put_with<'a, I>(&self, hashes: &[BlockHash], chunks: impl Fn(usize) -> I) -> Result<(), StoreError>
    where
        I: Iterator<Item = &'a [u8]> + Clone,
    {
        if hashes.is_empty() {
            return Ok(());
        }
        let format = self.cfg.format;
        let mut key = Vec::with_capacity(self.prefix.len() + 64);
        let cmds: Vec<Cmd> = hashes
            .iter()
            .enumerate()
            .map(|(i, h)| {
                self.write_key(h, &mut key);
                let header = PageHeader::new(&self.binding, h, chunks(i));
                let mut cmd = redis::cmd("SET");
                cmd.arg(&key[..]).arg(PageValue { header, chunks: chunks(i), len: format.value_bytes() });
                cmd
            })
            .collect();
        let replies = self.op(true, |conn| {
            let replies = self.pipeline(conn, cmds, false)?;
            // A full server refuses writes whatever the key: the whole put is `Full`.
            match replies.iter().find(|v| matches!(v, Value::ServerError(e) if e.code() == "OOM")) {
                Some(Value::ServerError(e)) => Err(RedisError::from(e.clone())),
                _ => Ok(replies),
            }
        })?;
        let c = &self.counters;
        let refused = replies.iter().filter(|v| matches!(v, Value::ServerError(_))).count();
        let written = hashes.len() - refused;
        Counters::add(&c.pages_put, written as u64);
        Counters::add(&c.bytes_written, (written * format.value_bytes()) as u64);
        if refused == 0 {
            return Ok(());
        }
        Counters::add(&c.key_errors, refused as u64);
        Counters::add(&c.failures, 1);
        let first = replies.iter().find_map(|v| match v {
            Value::ServerError(e) => Some(format!("{} {}", e.code(), e.details().unwrap_or_default())),
            _ => None,
        });
        let detail = format!("{refused} of {} pages not written: {}", hashes.len(), first.unwrap_or_default());
        Err(StoreError::Server { detail })
    }

    /// `GET` every page and check the leading run; `write(i, payload)` is called for
    /// each page of that run, after all of them were read and checked (so a failure of
    /// the operation writes nothing).
    ///
    /// On a single node the replies are read straight into the connection's staging
    /// buffer (one slot of [`PageFormat::value_bytes`] per page, grown to the largest
    /// batch read and reused) and checked as each arrives; in cluster mode the `redis`
    /// crate's replies are checked here.
    fn get_with(
        &self,
        hashes: &[BlockHash],
        mut write: impl FnMut(usize, &[u8]) -> Result<(), StoreError>,
    ) -> Result<Loaded, StoreError> {
        if hashes.is_empty() {
            return Ok(Loaded { pages: 0, stop: None });
        }
        let (format, binding) = (self.cfg.format, &self.binding);
        let mut key = Vec::with_capacity(self.prefix.len() + 64);
        let fetch = |conn: &mut Conn| -> RedisResult<Fetched> {
            match conn {
                Conn::Single(c) => {
                    let mut cmd = Vec::with_capacity(hashes.len() * (self.prefix.len() + 64 + 24));
                    for h in hashes {
                        self.write_key(h, &mut key);
                        pack_command(&mut cmd, &[b"GET", &key]);
                    }
                    let (misses, bytes) = c.get_pages(&cmd, hashes, binding)?;
                    Ok(Fetched { values: None, misses, bytes })
                }
                Conn::Cluster(_) => {
                    let cmds = self.keyed("GET", hashes, &mut key);
                    let values = self.pipeline(conn, cmds, true)?;
                    let mut bytes = 0u64;
                    let misses = values
                        .iter()
                        .zip(hashes)
                        .map(|(v, h)| match v {
                            Value::Nil => Some(Miss::Absent),
                            Value::BulkString(value) => {
                                bytes += value.len() as u64;
                                check_page(binding, h, value).err().map(Miss::Invalid)
                            }
                            Value::ServerError(_) => Some(Miss::Error),
                            _ => Some(Miss::Invalid(Invalid::Magic)),
                        })
                        .collect();
                    Ok(Fetched { values: Some(values), misses, bytes })
                }
            }
        };
        self.op_then(false, fetch, |conn, fetched| {
            if fetched.misses.len() != hashes.len() {
                let detail = format!("{} replies to {} GETs", fetched.misses.len(), hashes.len());
                return Err(StoreError::Server { detail });
            }
            let c = &self.counters;
            // Every value is counted, then the leading sound run is written.
            for miss in fetched.misses.iter().flatten() {
                let counter = match miss {
                    Miss::Absent => &c.absent,
                    Miss::Error => &c.key_errors,
                    Miss::Invalid(invalid) if invalid.is_forged() => &c.forged,
                    Miss::Invalid(invalid) if invalid.is_foreign() => &c.foreign,
                    Miss::Invalid(invalid) if invalid.is_corrupt() => &c.corrupt,
                    Miss::Invalid(_) => &c.mismatched,
                };
                Counters::add(counter, 1);
            }
            Counters::add(&c.bytes_read, fetched.bytes);
            let run = fetched.misses.iter().take_while(|m| m.is_none()).count();
            let stop = fetched.misses.get(run).copied().flatten();
            for i in 0..run {
                let value = match (&fetched.values, &*conn) {
                    (Some(values), _) => match &values[i] {
                        Value::BulkString(value) => &value[..],
                        _ => unreachable!("checked above"),
                    },
                    (None, Conn::Single(tcp)) => tcp.slot(i, format),
                    (None, Conn::Cluster(_)) => unreachable!("staged replies come from a single node"),
                };
                write(i, &value[HEADER_BYTES..])?;
            }
            Counters::add(&c.pages_loaded, run as u64);
            Ok(Loaded { pages: run, stop })
        })
    }
}

/// The replies to one pipeline of `GET`s: checked (`misses[i]` is `None` for a sound
/// page), held in `values` (cluster) or in the connection's staging buffer (single node).
struct Fetched {
    values: Option<Vec<Value>>,
    misses: Vec<Option<Miss>>,
    /// Bytes of the values read.
    bytes: u64,
}

/// Append the RESP encoding of the command `args` to `out`.
fn pack_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    let _ = write!(out, "*{}\r\n", args.len());
    for arg in args {
        let _ = write!(out, "${}\r\n", arg.len());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

impl PageStore for RedisStore {
    fn format(&self) -> PageFormat {
        self.cfg.format
    }

    fn exists_prefix(&self, hashes: &[BlockHash]) -> Result<usize, StoreError> {
        if hashes.is_empty() {
            return Ok(0);
        }
        let mut key = Vec::with_capacity(self.prefix.len() + 64);
        let cmds = self.keyed("EXISTS", hashes, &mut key);
        let replies = self.op(false, |conn| self.pipeline(conn, cmds, true))?;
        // An error reply for a key: absent (the prefix stops there), counted.
        let errors = replies.iter().filter(|v| matches!(v, Value::ServerError(_))).count();
        Counters::add(&self.counters.key_errors, errors as u64);
        Ok(replies.iter().take_while(|v| matches!(v, Value::Int(1))).count())
    }

    fn put(&self, hashes: &[BlockHash], pages: &[&[u8]]) -> Result<(), StoreError> {
        Self::check_lists(hashes, pages.len())?;
        let want = self.cfg.format.page_bytes();
        if let Some(p) = pages.iter().find(|p| p.len() != want) {
            return Err(StoreError::Shape { what: "page", got: p.len(), expected: want });
        }
        self.put_with(hashes, |i| core::iter::once(pages[i]))
    }

    fn get(&self, hashes: &[BlockHash], pages: &mut [&mut [u8]]) -> Result<Loaded, StoreError> {
        Self::check_lists(hashes, pages.len())?;
        let want = self.cfg.format.page_bytes();
        if let Some(p) = pages.iter().find(|p| p.len() != want) {
            return Err(StoreError::Shape { what: "page", got: p.len(), expected: want });
        }
        self.get_with(hashes, |i, payload| {
            pages[i].copy_from_slice(payload);
            Ok(())
        })
    }

    fn put_host(&self, pool: &HostKvPool, hashes: &[BlockHash], host_pages: &[u32]) -> Result<(), StoreError> {
        Self::check_lists(hashes, host_pages.len())?;
        self.check_pool(pool, host_pages)?;
        self.put_with(hashes, |i| pool.page_chunks(host_pages[i]).expect("checked above"))
    }

    fn get_host(&self, pool: &mut HostKvPool, hashes: &[BlockHash], host_pages: &[u32]) -> Result<Loaded, StoreError> {
        Self::check_lists(hashes, host_pages.len())?;
        self.check_pool(pool, host_pages)?;
        self.get_with(hashes, |i, payload| pool.write_page(host_pages[i], payload).map_err(StoreError::Host))
    }

    fn stats(&self) -> StoreStats {
        self.counters.snapshot(self.backoff.failures())
    }
}

/// A page's value as one command argument: the header, then the page's pieces, written
/// straight into the command's buffer.
struct PageValue<I> {
    header: PageHeader,
    chunks: I,
    len: usize,
}

impl<'a, I: Iterator<Item = &'a [u8]> + Clone> ToRedisArgs for PageValue<I> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        out.reserve_space_for_args([self.len]);
        let mut w = out.writer_for_next_arg();
        // Writing into the command's in-memory buffer cannot fail.
        let _ = w.write_all(self.header.as_bytes());
        for piece in self.chunks.clone() {
            let _ = w.write_all(piece);
        }
    }
}

/// A TCP stream whose every read and write waits at most until a deadline.
struct DeadlineStream {
    stream: TcpStream,
    deadline: Instant,
    /// The last timeouts set on the socket and when (re-set once they are stale by more
    /// than 1/16 of the operation's timeout, so the deadline is overrun by at most that).
    read_set: Option<Instant>,
    write_set: Option<Instant>,
    slack: Duration,
    /// Whether a wait ran out (the error the parser returns may not say so).
    timed_out: bool,
}

impl DeadlineStream {
    /// Time left, after re-setting the socket's timeout if it is stale.
    fn left(&mut self, write: bool) -> io::Result<()> {
        let now = Instant::now();
        let left = self.deadline.saturating_duration_since(now);
        if left.is_zero() {
            self.timed_out = true;
            return Err(io::Error::new(io::ErrorKind::TimedOut, "store operation deadline passed"));
        }
        let set = if write { &mut self.write_set } else { &mut self.read_set };
        if set.map_or(true, |at| now.duration_since(at) > self.slack) {
            if write {
                self.stream.set_write_timeout(Some(left))?;
            } else {
                self.stream.set_read_timeout(Some(left))?;
            }
            *set = Some(now);
        }
        Ok(())
    }

    fn note(&mut self, r: io::Result<usize>) -> io::Result<usize> {
        if let Err(e) = &r {
            if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                self.timed_out = true;
                return Err(io::Error::new(io::ErrorKind::TimedOut, "store operation deadline passed"));
            }
        }
        r
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.left(false)?;
        let r = self.stream.read(buf);
        self.note(r)
    }
}

impl Write for DeadlineStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.left(true)?;
        let r = self.stream.write(buf);
        self.note(r)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Bytes of the read buffer in front of a connection's stream (reply headers, short
/// replies, the first bytes of a bulk string; the rest of a page's value is read past
/// it, straight into the staging buffer).
const READ_BUFFER: usize = 64 << 10;

/// A [`DeadlineStream`] with a small read buffer: the `redis` crate's parser reads
/// through it ([`Read`]: buffered bytes first), and the store's own `GET` reply reader
/// ([`get_reply`](Self::get_reply)) frames replies on it and reads bulk strings into a
/// buffer of the caller's.
struct Reader {
    stream: DeadlineStream,
    buf: Box<[u8]>,
    /// `buf[pos..end]` is read and not yet consumed.
    pos: usize,
    end: usize,
}

/// One reply to a `GET`.
enum GetReply {
    /// `$-1` (RESP2) or `_` (RESP3).
    Nil,
    /// A bulk string of this many bytes: all of them in the slot when they fit, else its
    /// first [`HEADER_BYTES`] (the rest was read and dropped).
    Bulk(usize),
    /// `-ERR ...` or a RESP3 blob error (read whole): the stream is still in step.
    Error,
}

fn protocol(detail: String) -> RedisError {
    RedisError::from((ErrorKind::Parse, "unexpected reply", detail))
}

impl Reader {
    fn new(stream: DeadlineStream) -> Reader {
        Reader { stream, buf: vec![0u8; READ_BUFFER].into_boxed_slice(), pos: 0, end: 0 }
    }

    /// Read more bytes into the buffer (after what is there).
    fn fill(&mut self) -> io::Result<()> {
        if self.pos == self.end {
            (self.pos, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.pos..self.end, 0);
            (self.pos, self.end) = (0, self.end - self.pos);
        }
        if self.end == self.buf.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "reply line longer than the read buffer"));
        }
        match self.stream.read(&mut self.buf[self.end..])? {
            0 => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by the server")),
            n => {
                self.end += n;
                Ok(())
            }
        }
    }

    /// The next line (without its `\r\n`) as a range of the buffer, consumed.
    fn line(&mut self) -> io::Result<(usize, usize)> {
        let mut scanned = 0;
        loop {
            let window = &self.buf[self.pos + scanned..self.end];
            if let Some(at) = window.windows(2).position(|w| w == b"\r\n") {
                let (start, stop) = (self.pos, self.pos + scanned + at);
                self.pos = stop + 2;
                return Ok((start, stop));
            }
            // (Relative to `pos`, which `fill` may move.)
            scanned = (self.end - self.pos).saturating_sub(1);
            self.fill()?;
        }
    }

    /// The next line's type byte and the integer after it.
    fn header(&mut self) -> RedisResult<(u8, (usize, usize))> {
        let (start, stop) = self.line()?;
        match self.buf.get(start) {
            Some(&kind) => Ok((kind, (start + 1, stop))),
            None => Err(protocol("an empty reply line".into())),
        }
    }

    fn int(&self, (start, stop): (usize, usize)) -> RedisResult<i64> {
        core::str::from_utf8(&self.buf[start..stop])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| protocol(format!("`{}` is not a length", String::from_utf8_lossy(&self.buf[start..stop]))))
    }

    /// Fill `dst` from the buffer, then from the stream.
    fn read_into(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let have = (self.end - self.pos).min(dst.len());
        dst[..have].copy_from_slice(&self.buf[self.pos..self.pos + have]);
        self.pos += have;
        let mut at = have;
        while at < dst.len() {
            match self.stream.read(&mut dst[at..])? {
                0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed by the server")),
                n => at += n,
            }
        }
        Ok(())
    }

    /// Consume `n` bytes.
    fn skip(&mut self, mut n: usize) -> io::Result<()> {
        loop {
            let have = (self.end - self.pos).min(n);
            self.pos += have;
            n -= have;
            if n == 0 {
                return Ok(());
            }
            self.fill()?;
        }
    }

    /// Consume the `\r\n` after a bulk string.
    fn crlf(&mut self) -> RedisResult<()> {
        while self.end - self.pos < 2 {
            self.fill()?;
        }
        if &self.buf[self.pos..self.pos + 2] != b"\r\n" {
            return Err(protocol("a bulk string not followed by CRLF".into()));
        }
        self.pos += 2;
        Ok(())
    }

    /// Consume `frames` whole replies of any RESP2/RESP3 type (pushes, attributes).
    fn skip_frames(&mut self, mut frames: u64) -> RedisResult<()> {
        while frames > 0 {
            frames -= 1;
            let (kind, rest) = self.header()?;
            let n = match kind {
                b'+' | b'-' | b':' | b'_' | b',' | b'#' | b'(' => continue,
                b'$' | b'=' | b'!' | b'*' | b'~' | b'>' | b'%' | b'|' => self.int(rest)?,
                _ => return Err(protocol(format!("reply type `{}`", kind.escape_ascii()))),
            };
            let Ok(n) = u64::try_from(n) else { continue }; // -1: a RESP2 nil
            match kind {
                b'$' | b'=' | b'!' => {
                    self.skip(usize::try_from(n).map_err(|_| protocol("a huge bulk string".into()))?)?;
                    self.crlf()?;
                }
                b'*' | b'~' | b'>' => frames = frames.saturating_add(n),
                b'%' => frames = frames.saturating_add(n.saturating_mul(2)),
                // An attribute map, then the value it annotates.
                _ => frames = frames.saturating_add(n.saturating_mul(2)).saturating_add(1),
            }
        }
        Ok(())
    }

    /// Read one reply to a `GET`: nil, an error, or a bulk string into `slot` (all of it
    /// when it fits, else its first [`HEADER_BYTES`]; `slot` holds at least that many).
    /// Pushes and attributes before it are skipped; any other reply is a protocol error
    /// (the connection is dropped).
    fn get_reply(&mut self, slot: &mut [u8]) -> RedisResult<GetReply> {
        loop {
            let (kind, rest) = self.header()?;
            match kind {
                b'$' => {
                    let n = self.int(rest)?;
                    if n == -1 {
                        return Ok(GetReply::Nil);
                    }
                    let n = usize::try_from(n).map_err(|_| protocol(format!("bulk string length {n}")))?;
                    if n <= slot.len() {
                        self.read_into(&mut slot[..n])?;
                    } else {
                        self.read_into(&mut slot[..HEADER_BYTES])?;
                        self.skip(n - HEADER_BYTES)?;
                    }
                    self.crlf()?;
                    return Ok(GetReply::Bulk(n));
                }
                b'_' => return Ok(GetReply::Nil),
                b'-' => return Ok(GetReply::Error),
                b'!' => {
                    let n = self.int(rest)?;
                    let n = usize::try_from(n)
                        .ok()
                        .filter(|&n| n <= READ_BUFFER)
                        .ok_or_else(|| protocol(format!("blob error length {n}")))?;
                    self.skip(n)?;
                    self.crlf()?;
                    return Ok(GetReply::Error);
                }
                b'>' => {
                    let n = self.int(rest)?;
                    self.skip_frames(u64::try_from(n).unwrap_or(0))?;
                }
                b'|' => {
                    let n = self.int(rest)?;
                    self.skip_frames(u64::try_from(n).unwrap_or(0).saturating_mul(2))?;
                }
                _ => return Err(protocol(format!("reply type `{}` to a GET", kind.escape_ascii()))),
            }
        }
    }
}

impl Read for Reader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.end {
            return self.stream.read(buf);
        }
        let n = (self.end - self.pos).min(buf.len());
        buf[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// A single-node connection over a [`DeadlineStream`]: the `redis` crate's command
/// encoding and reply parser for [`ConnectionLike`] (`EXISTS`, `SET`, the handshake,
/// [`RedisStore::with_connection`]), the store's own reply reader for pipelines of
/// `GET`s ([`get_pages`](Self::get_pages)), which reads each value straight into the
/// staging buffer. After any I/O or protocol error it is closed (the replies in flight
/// can no longer be matched to their commands) and the store drops it.
struct TcpConn {
    reader: Reader,
    parser: redis::Parser,
    /// Page values of the last `get_pages`, slot `i` at `i * value_bytes`: grown to the
    /// largest batch read, reused, dropped with the connection.
    staging: Vec<u8>,
    db: i64,
    open: bool,
}

impl TcpConn {
    fn connect(info: &ConnectionInfo, connect_timeout: Duration, timeout: Duration) -> Result<TcpConn, StoreError> {
        let ConnectionAddr::Tcp(host, port) = info.addr() else {
            return Err(StoreError::Config { detail: "not a TCP address".into() });
        };
        let fail = |e: io::Error| StoreError::Connection { detail: format!("{host}:{port}: {e}") };
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
        let mut stream = None;
        for addr in (host.as_str(), *port).to_socket_addrs().map_err(fail)? {
            match TcpStream::connect_timeout(&addr, connect_timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e,
            }
        }
        let stream = stream.ok_or(last).map_err(fail)?;
        stream.set_nodelay(true).map_err(fail)?;
        let settings = info.redis_settings();
        let mut conn = TcpConn {
            reader: Reader::new(DeadlineStream {
                stream,
                deadline: Instant::now(),
                read_set: None,
                write_set: None,
                slack: timeout / 16,
                timed_out: false,
            }),
            parser: redis::Parser::new(),
            staging: Vec::new(),
            db: settings.db(),
            open: true,
        };
        conn.arm(connect_timeout.max(timeout));
        let handshake = |conn: &mut TcpConn| -> RedisResult<()> {
            if let Some(password) = settings.password() {
                let mut auth = redis::cmd("AUTH");
                if let Some(user) = settings.username() {
                    auth.arg(user);
                }
                auth.arg(password).exec(conn)?;
            }
            if settings.db() != 0 {
                redis::cmd("SELECT").arg(settings.db()).exec(conn)?;
            }
            Ok(())
        };
        handshake(&mut conn).map_err(|e| StoreError::Connection { detail: format!("{host}:{port}: {e}") })?;
        Ok(conn)
    }

    fn arm(&mut self, timeout: Duration) {
        let stream = &mut self.reader.stream;
        stream.deadline = Instant::now() + timeout;
        stream.slack = timeout / 16;
        stream.read_set = None;
        stream.write_set = None;
        stream.timed_out = false;
    }

    fn closed<T>(&mut self, e: RedisError) -> RedisResult<T> {
        self.open = false;
        Err(e)
    }

    fn send(&mut self, bytes: &[u8]) -> RedisResult<()> {
        if !self.open {
            return Err(RedisError::from(io::Error::new(io::ErrorKind::NotConnected, "connection closed")));
        }
        match self.reader.stream.write_all(bytes) {
            Ok(()) => Ok(()),
            Err(e) => self.closed(e.into()),
        }
    }

    /// Send `cmd`, a pipeline of one `GET` per page of `hashes`, and read and check the
    /// replies: each value goes straight into its slot of the staging buffer and is
    /// checked there against `binding`; `misses[i]` is `None` for a sound page. Also
    /// the bytes of the values. A server error reply is a miss for its page
    /// ([`Miss::Error`]); the replies after it are read and checked as usual.
    fn get_pages(
        &mut self,
        cmd: &[u8],
        hashes: &[BlockHash],
        binding: &PageBinding,
    ) -> RedisResult<(Vec<Option<Miss>>, u64)> {
        let value_bytes = binding.format().value_bytes();
        let Some(need) = hashes.len().checked_mul(value_bytes) else {
            return Err(RedisError::from((ErrorKind::Client, "batch too large for the staging buffer")));
        };
        if self.open && self.reader.pos != self.reader.end {
            let e = protocol(format!("{} bytes nobody asked for", self.reader.end - self.reader.pos));
            return self.closed(e);
        }
        self.send(cmd)?;
        if self.staging.len() < need {
            // Zeroed lazily by the allocator; the pages are faulted in once, by the
            // first read into them.
            self.staging = vec![0u8; need];
        }
        let mut misses = Vec::with_capacity(hashes.len());
        let mut bytes = 0u64;
        for (h, slot) in hashes.iter().zip(self.staging.chunks_exact_mut(value_bytes)) {
            let miss = match self.reader.get_reply(slot) {
                Ok(GetReply::Nil) => Some(Miss::Absent),
                Ok(GetReply::Bulk(len)) => {
                    bytes += len as u64;
                    if len <= value_bytes {
                        check_page(binding, h, &slot[..len]).err().map(Miss::Invalid)
                    } else {
                        // Too long for a page of this format: what its header says,
                        // else a length mismatch.
                        match check_page(binding, h, &slot[..HEADER_BYTES]) {
                            Err(Invalid::Length { .. }) | Ok(_) => {
                                Some(Miss::Invalid(Invalid::Length { found: len - HEADER_BYTES }))
                            }
                            Err(invalid) => Some(Miss::Invalid(invalid)),
                        }
                    }
                }
                Ok(GetReply::Error) => Some(Miss::Error),
                Err(e) => {
                    self.open = false;
                    return Err(e);
                }
            };
            misses.push(miss);
        }
        Ok((misses, bytes))
    }

    /// Staging slot `i` (a sound page's value after [`get_pages`](Self::get_pages)).
    fn slot(&self, i: usize, format: PageFormat) -> &[u8] {
        let n = format.value_bytes();
        &self.staging[i * n..(i + 1) * n]
    }

    fn recv(&mut self) -> RedisResult<Value> {
        loop {
            match self.parser.parse_value(&mut self.reader) {
                Ok(Value::Push { .. }) => continue,
                Ok(v) => return Ok(v),
                Err(e) => return self.closed(e),
            }
        }
    }
}

impl ConnectionLike for TcpConn {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        self.send(cmd)?;
        self.recv()
    }

    fn req_packed_commands(&mut self, cmd: &[u8], offset: usize, count: usize) -> RedisResult<Vec<Value>> {
        self.send(cmd)?;
        let mut replies = Vec::with_capacity(count);
        for i in 0..offset + count {
            // Stop at the first error: the rest of the replies are lost with the
            // connection (unlike the crate's own connection, which reads on).
            let v = self.recv()?;
            if i >= offset {
                replies.push(v);
            }
        }
        Ok(replies)
    }

    fn get_db(&self) -> i64 {
        self.db
    }

    fn check_connection(&mut self) -> bool {
        redis::cmd("PING").exec(self).is_ok()
    }

    fn is_open(&self) -> bool {
        self.open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store_of(namespace: &str, model_id: &str) -> RedisStore {
        let format = PageFormat { page_size: 1, bytes_per_token: 1 };
        let mut cfg = RedisStoreConfig::new("redis://127.0.0.1:1", model_id, format);
        cfg.namespace = namespace.into();
        RedisStore::new(cfg).unwrap()
    }

    /// Namespace `a:b` with model `c` and namespace `a` with model `b:c` were both
    /// `a:b:c:<hash>`: two tenants read each other's pages. Every pair of (namespace,
    /// model) here is a different key now, empty parts included.
    #[test]
    fn keys_of_distinct_namespace_and_model_pairs_differ() {
        let h = [0xa5; 32];
        let pairs = [
            ("a:b", "c"),
            ("a", "b:c"),
            ("a:b:c", ""),
            ("", "a:b:c"),
            ("", "a:"),
            (":a", ""),
            ("", ""),
            (":", ""),
            ("", ":"),
            ("a", ""),
            ("", "a"),
            ("a%3Ab", "c"),
            ("a%", "3Ab:c"),
            ("a%3A", "b"),
            ("a%253A", "b"),
            ("{a}", "b"),
            ("%7Ba%7D", "b"),
        ];
        let mut keys = std::collections::HashSet::new();
        for (ns, model) in pairs {
            let key = store_of(ns, model).key(&h);
            assert!(
                keys.insert(key.clone()),
                "{ns:?} + {model:?} -> {:?} is another pair's key",
                String::from_utf8(key)
            );
        }
        // The common case reads as before: `{namespace}:{model_id}:{hash hex}`.
        let key = store_of("prod", "llama-3-8b").key(&h);
        assert_eq!(key, format!("prod:llama-3-8b:{}", "a5".repeat(32)).into_bytes());
        let key = store_of("a:b", "c").key(&[0x01; 32]);
        assert_eq!(key, format!("a%3Ab:c:{}", "01".repeat(32)).into_bytes());
        let key = store_of("50%{x}", "").key(&[0xff; 32]);
        assert_eq!(key, format!("50%25%7Bx%7D::{}", "ff".repeat(32)).into_bytes());
    }

    /// Percent-decode a key's two escaped parts (the test's inverse of the encoding).
    fn decode(key: &[u8]) -> (String, String, &[u8]) {
        let mut parts = key.splitn(3, |&b| b == b':');
        let mut part = || {
            let p = parts.next().unwrap();
            let mut out = Vec::new();
            let mut i = 0;
            while i < p.len() {
                if p[i] == b'%' {
                    out.push(u8::from_str_radix(std::str::from_utf8(&p[i + 1..i + 3]).unwrap(), 16).unwrap());
                    i += 3;
                } else {
                    assert!(!b"{}".contains(&p[i]), "an unescaped brace in {key:?}");
                    out.push(p[i]);
                    i += 1;
                }
            }
            String::from_utf8(out).unwrap()
        };
        let (ns, model) = (part(), part());
        (ns, model, parts.next().unwrap())
    }

    /// Every (namespace, model) pair of up to three characters from an alphabet of the
    /// separator, the escape, braces and a letter has a key of its own, and the key
    /// decodes back to the pair (the encoding is injective).
    #[test]
    fn the_key_prefix_is_injective() {
        let alphabet = ['a', ':', '%', '{', '}', 'é'];
        let mut strings = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..3 {
            last = last.iter().flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}"))).collect();
            strings.extend(last.iter().cloned());
        }
        let h = [0x3c; 32];
        let mut seen = std::collections::HashSet::new();
        for ns in &strings {
            for model in &strings {
                let mut key = key_prefix(ns, model, "");
                let len = key.len();
                key.extend_from_slice("3c".repeat(32).as_bytes());
                assert_eq!(decode(&key), (ns.clone(), model.clone(), &key[len..]));
                assert!(seen.insert(key));
            }
        }
        assert_eq!(seen.len(), strings.len() * strings.len());
        // The store's own key is that prefix and the hash.
        let s = store_of("a:%", "{m}");
        assert_eq!(s.key(&h), [key_prefix("a:%", "{m}", ""), "3c".repeat(32).into_bytes()].concat());
    }

    /// A salt adds one part to the key, its digest (not the salt): distinct salts have
    /// distinct keys, and no salted key is an unsalted one's.
    #[test]
    fn a_salt_adds_its_digest_to_the_key() {
        let h = [0x11; 32];
        let salted = |ns: &str, model: &str, salt: &str| {
            let mut cfg = store_of(ns, model).config().clone();
            cfg.salt = salt.into();
            RedisStore::new(cfg).unwrap().key(&h)
        };
        let mut keys = std::collections::HashSet::new();
        for (ns, model, salt) in
            [("a", "b", ""), ("a", "b", "t1"), ("a", "b", "t2"), ("a", "b", ":"), ("a:b", "", "t1"), ("a", "b:c", "")]
        {
            let key = salted(ns, model, salt);
            assert!(keys.insert(key.clone()), "{ns:?} {model:?} {salt:?}");
            let text = String::from_utf8(key).unwrap();
            let parts: Vec<&str> = text.split(':').collect();
            assert_eq!(parts.len(), if salt.is_empty() { 3 } else { 4 }, "{text}");
            if !salt.is_empty() {
                assert!(parts[2].len() == 32 && parts[2].bytes().all(|b| b.is_ascii_hexdigit()), "{text}");
                assert!(!text.contains("t1") && !text.contains("t2"), "{text}");
            }
        }
        assert_eq!(salted("prod", "m", ""), format!("prod:m:{}", "11".repeat(32)).into_bytes());
    }
}
