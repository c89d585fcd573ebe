//! Real Redis servers for the store tests and bench: `redis-server` from PATH on free
//! loopback ports, no persistence, killed on drop. No mock stands in for Redis.
//!
//! Without `redis-server` on PATH the helpers panic with a message saying how to install
//! it, unless `KVPOOL_SKIP_REDIS=1` is set (then they return `None` and the caller skips):
//! CI installs it, so a silent skip would hide breakage.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where `redis-server` and `redis-cli` are, or `None` when they are missing and
/// `KVPOOL_SKIP_REDIS=1` says to skip.
pub fn redis_bin() -> Option<(PathBuf, PathBuf)> {
    let find = |name: &str| {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    };
    match (find("redis-server"), find("redis-cli")) {
        (Some(s), Some(c)) => Some((s, c)),
        _ if std::env::var("KVPOOL_SKIP_REDIS").is_ok_and(|v| v == "1") => {
            eprintln!("redis-server/redis-cli not on PATH and KVPOOL_SKIP_REDIS=1: skipping");
            None
        }
        _ => panic!(
            "redis-server and redis-cli are needed on PATH for the store tests \
             (Debian: apt-get install -y redis-server redis-tools; .ci/run does this). \
             Set KVPOOL_SKIP_REDIS=1 to skip these tests instead."
        ),
    }
}

/// A free loopback port (with `port + 10000`, the cluster bus port, free too when
/// `bus` is set).
pub fn free_port(bus: bool) -> u16 {
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = l.local_addr().unwrap().port();
        if !bus {
            return port;
        }
        if port < 55000 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port found");
}

/// One `redis-server` process.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: PathBuf,
    server: PathBuf,
    extra: Vec<String>,
}

impl RedisServer {
    /// A fresh server on a free port (`None`: skipped, see the module docs).
    pub fn start() -> Option<RedisServer> {
        Self::start_with(&[])
    }

    /// As [`start`](Self::start), with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> Option<RedisServer> {
        let (server, _) = redis_bin()?;
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let cluster = extra.iter().any(|a| a == "--cluster-enabled");
        // A port picked free can be taken before the server binds it: try a few.
        for attempt in 0..5 {
            let port = free_port(cluster);
            let dir = std::env::temp_dir().join(format!("kvpool-redis-{}-{port}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create the server's directory");
            let mut s = RedisServer { port, child: None, dir, server: server.clone(), extra: extra.clone() };
            if s.spawn() {
                return Some(s);
            }
            eprintln!("redis-server on port {port} did not come up (attempt {attempt}): {}", s.log());
        }
        panic!("redis-server did not start");
    }

    fn spawn(&mut self) -> bool {
        let child = Command::new(&self.server)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let ok = wait_for_ping(self.port, Duration::from_secs(10));
        if !ok {
            self.kill();
        }
        ok
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
    }

    /// SIGKILL the server and reap it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start a new server process on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.spawn() {
            assert!(Instant::now() < deadline, "redis-server did not restart on port {}: {}", self.port, self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Send the process a signal by name (`STOP`, `CONT`).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill").arg(format!("-{name}")).arg(self.pid().to_string()).status().unwrap();
        assert!(ok.success(), "kill -{name} failed");
    }

    /// A plain `redis` connection to the server (for raw commands in tests).
    pub fn raw(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection_with_timeout(Duration::from_secs(5)).unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn wait_for_ping(port: u16, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            let pong = redis::Client::open(format!("redis://127.0.0.1:{port}"))
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if pong.is_ok_and(|p| p == "PONG") {
                return true;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// A local Redis Cluster of three masters, no replicas.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Option<RedisCluster> {
        let (_, cli) = redis_bin()?;
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_with(&["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"]))
            .collect::<Option<_>>()?;
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = Command::new(&cli)
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        // Every node must see the whole slot map before clients use it.
        let deadline = Instant::now() + Duration::from_secs(20);
        for n in &cluster.nodes {
            loop {
                let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut n.raw()).unwrap();
                if info.contains("cluster_state:ok") && info.contains("cluster_slots_assigned:16384") {
                    break;
                }
                assert!(Instant::now() < deadline, "cluster did not converge: {info}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(cluster)
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }
}
