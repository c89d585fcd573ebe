//! `kvpool`: the command-line tool.
//!
//! `kvpool replay` replays a request trace (by default the bundled Mooncake
//! conversation trace) through kvpool's allocators, request rows and prefix cache, the
//! way an inference engine's scheduler drives them, and reports hit rate, memory use,
//! throughput and latency. See `kvpool replay --help`.

#[cfg(not(loom))]
mod cli {
    use std::fmt::Write as _;
    use std::io::{IsTerminal, Write as _};
    use std::path::{Path, PathBuf};
    use std::process::ExitCode;

    use clap::{Args, Parser, Subcommand};
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    use kvpool::baseline::hicache_ref::WritePolicy;
    use kvpool::radix::EvictionPolicy;
    use kvpool::replay::{
        self, CacheKind, Ceiling, EnginesConfig, HostTierConfig, HybridConfig, Mode, Model, ReplayConfig, ReplayError,
        Router, StoreTierConfig, SwaConfig, Trace,
    };

    #[derive(Parser)]
    #[command(name = "kvpool", version, about = "Lock-free KV-cache memory management for LLM inference engines")]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[derive(Subcommand)]
    enum Command {
        /// Replay a request trace through the allocators and the prefix cache, as a
        /// scheduler would, and report hit rate, memory use, throughput and latency.
        Replay(ReplayArgs),
    }

    /// `--policy`: one of the cache's policies, or an offline model (the optimum or an
    /// informed ceiling).
    #[derive(Clone, Copy, Debug)]
    enum PolicyArg {
        Cache(EvictionPolicy),
        Offline(Ceiling),
    }

    fn parse_policy(s: &str) -> Result<PolicyArg, String> {
        if let Some(c) = Ceiling::from_name(s)? {
            return Ok(PolicyArg::Offline(c));
        }
        s.parse::<EvictionPolicy>().map(PolicyArg::Cache).map_err(|e| {
            format!("{e}, optimal, oracle-return, oracle-return-W, model-lhd, model-lhd-classes, model-lhd-age")
        })
    }

    #[derive(Args)]
    struct ReplayArgs {
        /// JSON-lines trace in the Mooncake format (plain or gzip); default: the
        /// bundled Mooncake conversation trace.
        #[arg(long, value_name = "PATH")]
        trace: Option<PathBuf>,
        /// Token capacity of the KV pool: a whole number of pages (a multiple of
        /// --page-size; anything else is an error, not silently rounded down).
        #[arg(long, value_name = "N", default_value_t = replay::DEFAULT_CAPACITY_TOKENS)]
        capacity_tokens: usize,
        /// Tokens per page.
        #[arg(long, value_name = "P", default_value_t = replay::DEFAULT_PAGE_SIZE)]
        page_size: u32,
        /// Eviction policy: lru, lfu, fifo, mru, filo, priority (SGLang's), hinted
        /// (kvpool's: leaves the waiting queue or the routers' look-ups want soon go
        /// last, the others least frequently used with dynamic aging), reuse (kvpool's:
        /// as hinted, with each hit weighted by the learned chance that a prefix of its
        /// conversation depth is extended again), optimal (the
        /// offline optimum, Belady's rule on the whole trace's future, computed by a
        /// model of the sequential replay: a ceiling, not a policy a server can run;
        /// sequential mode, the default with it), oracle-return (an informed ceiling
        /// in the same model: knows whether a later request uses a leaf, not when;
        /// leaves no later request uses go first, then LRU) or oracle-return-W (knows
        /// only whether the leaf is used within the next W requests, W a power of two
        /// up to 65536: those go last, LRU within each class); model-lhd,
        /// model-lhd-classes, model-lhd-age: an online policy (least hit density,
        /// learned online) measured in the same model, not in the cache (whole leaves).
        #[arg(long, default_value = "lru", value_parser = parse_policy)]
        policy: PolicyArg,
        /// Upcoming requests the scheduler tells the cache about under --policy
        /// hinted or reuse: the waiting queue in sequential mode, the routers' window in overlap
        /// mode [default: --max-running].
        #[arg(long, value_name = "N")]
        lookahead: Option<usize>,
        /// Evict only the pages a shortfall needs, from a leaf's tail, instead of
        /// whole leaves (SGLang's semantics, the default). kvpool's cache and
        /// --policy optimal.
        #[arg(long)]
        partial_evict: bool,
        /// sequential (one request at a time, deterministic) or overlap (scheduler,
        /// output and router threads at once). Default: overlap; sequential with
        /// --model hybrid (its only mode).
        #[arg(long)]
        mode: Option<Mode>,
        /// Requests running at once (overlap mode).
        #[arg(long, value_name = "R", default_value_t = replay::DEFAULT_MAX_RUNNING)]
        max_running: usize,
        /// Router threads matching upcoming prompts read-only (overlap mode).
        #[arg(long, value_name = "K", default_value_t = replay::DEFAULT_ROUTERS)]
        routers: usize,
        /// Which prefix cache to drive: kvpool (the concurrent RadixCache), reference
        /// (the simple single-threaded tree behind a mutex) or vectrie (the TGI-style
        /// trie behind a mutex; not with a host tier) [default: kvpool].
        #[arg(long)]
        cache: Option<CacheKind>,
        /// A host-memory tier of N tokens under the device pool (SGLang's HiCache):
        /// evicted KV that was backed up is loaded back on a later match. Runs kvpool's
        /// HiRadixCache (with --cache reference, the two-tier reference tree),
        /// sequential mode.
        #[arg(long, value_name = "N", conflicts_with = "host_ratio")]
        host_capacity_tokens: Option<usize>,
        /// A host tier of this many times --capacity-tokens [SGLang's default ratio:
        /// 2.0]. Implies the host tier.
        #[arg(long, value_name = "RATIO")]
        host_ratio: Option<f64>,
        /// When KV is copied to host: write_through (at its first hit, the default),
        /// write_through_selective (at its second) or write_back (when evicted from the
        /// device). Implies the host tier (of --host-ratio's default).
        #[arg(long, value_name = "POLICY", value_parser = parse_write_policy)]
        write_policy: Option<WritePolicy>,
        /// KV bytes per token across all layers, for the bytes the host tier moves
        /// [default: 131072, Llama-3-8B in bf16].
        #[arg(long, value_name = "BYTES")]
        transfer_bytes_per_token: Option<u64>,
        /// Host link bandwidth in GB/s, for the transfer time [default: 50].
        #[arg(long, value_name = "GBPS")]
        link_gbps: Option<f64>,
        /// attention (KV only, the default), hybrid (a Mamba hybrid such as
        /// Qwen3-Next: KV plus one recurrent state per request, cached at checkpoints
        /// in kvpool's MambaRadixCache; sequential mode) or swa (sliding-window and
        /// full-attention layers such as gpt-oss: a full and a window KV pool, kvpool's
        /// SwaRadixCache; sequential mode; implied by --swa-window / --swa-ratio).
        #[arg(long)]
        model: Option<Model>,
        /// Tokens a sliding-window layer attends to [default: 128, gpt-oss's
        /// sliding_window]. Implies --model swa.
        #[arg(long, value_name = "TOKENS")]
        swa_window: Option<usize>,
        /// The window pool's size as a fraction of the full pool [default: 0.8, SGLang's
        /// --swa-full-tokens-ratio]. Implies --model swa.
        #[arg(long, value_name = "RATIO")]
        swa_ratio: Option<f64>,
        /// Requests keep the window KV of tokens that fell out of their window until
        /// they finish (by default they release it as they decode, as SGLang does).
        /// Implies --model swa.
        #[arg(long)]
        swa_keep_window: bool,
        /// State slots in the hybrid model's Mamba pool. Default: as much state memory
        /// as --mamba-memory-ratio times the KV memory (300 at the default capacity).
        #[arg(long, value_name = "N", conflicts_with_all = ["mamba_state_bytes", "kv_bytes_per_token", "mamba_memory_ratio"])]
        mamba_states: Option<u64>,
        /// Bytes of one request's Mamba state, to size the pool [default: 77266944,
        /// Qwen3-Next-80B-A3B's 36 Gated-DeltaNet layers].
        #[arg(long, value_name = "BYTES")]
        mamba_state_bytes: Option<u64>,
        /// KV bytes per token, to size the state pool [default: 24576, Qwen3-Next's 12
        /// full-attention layers].
        #[arg(long, value_name = "BYTES")]
        kv_bytes_per_token: Option<u64>,
        /// State memory per KV memory, to size the state pool [default: 0.9, SGLang's
        /// --mamba-full-memory-ratio].
        #[arg(long, value_name = "RATIO")]
        mamba_memory_ratio: Option<f64>,
        /// Hybrid prefill checkpoints at multiples of this many tokens (a whole number
        /// of pages) [default: 64].
        #[arg(long, value_name = "TOKENS")]
        mamba_chunk: Option<usize>,
        /// Hybrid decode checkpoints every this many tokens (a whole number of chunks)
        /// [default: 256].
        #[arg(long, value_name = "TOKENS")]
        mamba_track_interval: Option<usize>,
        /// Engine instances the trace is split across, each with its own device pool
        /// (--capacity-tokens) and host tier (--host-capacity-tokens / --host-ratio);
        /// with --store they share it, without it each runs alone (the baseline).
        /// Implies the host tier, sequential mode.
        #[arg(long, value_name = "N")]
        engines: Option<usize>,
        /// How requests go to engines: round_robin, or prefix (by the hash of the first
        /// --route-tokens tokens, so a conversation stays on one engine).
        #[arg(long, value_name = "ROUTER")]
        router: Option<Router>,
        /// Tokens the prefix router hashes [default: 1024; every request of the bundled
        /// trace starts with the same 512-token block].
        #[arg(long, value_name = "TOKENS")]
        route_tokens: Option<usize>,
        /// A shared store tier under the engines' host tiers: redis://HOST:PORT, or
        /// several comma-separated seed nodes of a Redis Cluster (needs the `redis`
        /// feature). Each run writes under a key namespace of its own. Implies the host
        /// tier, sequential mode.
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// The --store URL is a Redis Cluster node (implied by several URLs).
        #[arg(long)]
        store_cluster: bool,
        /// Payload bytes per token of a stored page [default: 8; real KV: 131072 for
        /// Llama-3-8B in bf16].
        #[arg(long, value_name = "BYTES")]
        store_bytes_per_token: Option<u64>,
        /// Deadline of one store operation, milliseconds [default: 500].
        #[arg(long, value_name = "MS")]
        store_timeout_ms: Option<u64>,
        /// Print one JSON object on stdout instead of the table.
        #[arg(long)]
        json: bool,
        /// Replay only the first N requests.
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
        /// Draw cache occupancy and cumulative hit rate against request index into an
        /// SVG file. It is written beside FILE and renamed over it when the replay is
        /// done: an existing FILE is left as it was if the replay fails.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
    }

    /// The exit status of a process whose output pipe closed: what a shell reports for
    /// one killed by SIGPIPE (128 + 13), as `yes | head -1` gives.
    const BROKEN_PIPE_STATUS: u8 = 141;

    /// Why the command failed.
    enum Failure {
        Replay(ReplayError),
        /// stdout's reader went away (`kvpool replay | head -1`): stop quietly.
        BrokenPipe,
        Stdout(std::io::Error),
    }

    impl From<ReplayError> for Failure {
        fn from(e: ReplayError) -> Self {
            Failure::Replay(e)
        }
    }

    pub fn main() -> ExitCode {
        let cli = Cli::parse();
        let result = match cli.command {
            Command::Replay(args) => run_replay(args),
        };
        let message = match result {
            Ok(()) => return ExitCode::SUCCESS,
            Err(Failure::BrokenPipe) => return ExitCode::from(BROKEN_PIPE_STATUS),
            Err(Failure::Replay(e)) => format!("error: {e}"),
            Err(Failure::Stdout(e)) => format!("error: cannot write to stdout: {e}"),
        };
        // Not `eprintln!`, which panics if stderr is closed too.
        let _ = writeln!(std::io::stderr(), "{message}");
        ExitCode::FAILURE
    }

    /// Write `text` to stdout; a closed pipe is [`Failure::BrokenPipe`], not a panic.
    fn print(text: &str) -> Result<(), Failure> {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes()).and_then(|()| out.flush()).map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => Failure::BrokenPipe,
            _ => Failure::Stdout(e),
        })
    }

    /// The plot's temporary file, beside the target: created before the replay (so an
    /// unwritable place fails early), renamed over the target at the end, removed if
    /// anything fails first. The target is never truncated.
    struct PlotFile {
        target: PathBuf,
        temp: PathBuf,
        done: bool,
    }

    impl PlotFile {
        fn create(target: &Path) -> Result<PlotFile, ReplayError> {
            let fail = |e: std::io::Error| ReplayError::Plot(format!("{}: {e}", target.display()));
            let name = target.file_name().ok_or_else(|| fail(std::io::ErrorKind::InvalidInput.into()))?;
            // The plot is renamed over the target at the end: a directory there would
            // fail only then, after the report was printed.
            if target.is_dir() {
                return Err(ReplayError::Plot(format!("{}: is a directory", target.display())));
            }
            let mut temp_name = std::ffi::OsString::from(".");
            temp_name.push(name);
            temp_name.push(format!(".{}.tmp", std::process::id()));
            let temp = target.with_file_name(temp_name);
            std::fs::OpenOptions::new().write(true).create_new(true).open(&temp).map_err(fail)?;
            Ok(PlotFile { target: target.to_path_buf(), temp, done: false })
        }

        fn finish(mut self, report: &replay::Report) -> Result<(), ReplayError> {
            replay::write_plot(report, &self.temp)?;
            std::fs::rename(&self.temp, &self.target)
                .map_err(|e| ReplayError::Plot(format!("{}: {e}", self.target.display())))?;
            self.done = true;
            Ok(())
        }
    }

    impl Drop for PlotFile {
        fn drop(&mut self) {
            if !self.done {
                let _ = std::fs::remove_file(&self.temp);
            }
        }
    }

    /// The hybrid options; any of them without `--model hybrid` is an error (it
    /// would be silently ignored).
    fn hybrid_config(args: &ReplayArgs, model: Model) -> Result<HybridConfig, ReplayError> {
        let given = [
            ("--mamba-states", args.mamba_states.is_some()),
            ("--mamba-state-bytes", args.mamba_state_bytes.is_some()),
            ("--kv-bytes-per-token", args.kv_bytes_per_token.is_some()),
            ("--mamba-memory-ratio", args.mamba_memory_ratio.is_some()),
            ("--mamba-chunk", args.mamba_chunk.is_some()),
            ("--mamba-track-interval", args.mamba_track_interval.is_some()),
        ];
        if model != Model::Hybrid {
            if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
                return Err(ReplayError::Config(format!("{flag} is an option of --model hybrid")));
            }
        }
        let d = HybridConfig::default();
        let memory_ratio_permille = match args.mamba_memory_ratio {
            None => d.memory_ratio_permille,
            Some(r) if r.is_finite() && (0.001..=1000.0).contains(&r) => (r * 1000.0).round() as u32,
            Some(r) => {
                return Err(ReplayError::Config(format!(
                    "--mamba-memory-ratio must be between 0.001 and 1000, not {r}"
                )))
            }
        };
        Ok(HybridConfig {
            states: args.mamba_states,
            state_bytes: args.mamba_state_bytes.unwrap_or(d.state_bytes),
            kv_bytes_per_token: args.kv_bytes_per_token.unwrap_or(d.kv_bytes_per_token),
            memory_ratio_permille,
            chunk_size: args.mamba_chunk.unwrap_or(d.chunk_size),
            track_interval: args.mamba_track_interval.unwrap_or(d.track_interval),
        })
    }

    /// The model: `--model`, or swa when an SWA option is given without it; SWA
    /// options with another model are an error.
    fn model_of(args: &ReplayArgs) -> Result<Model, ReplayError> {
        let swa_flag = [
            ("--swa-window", args.swa_window.is_some()),
            ("--swa-ratio", args.swa_ratio.is_some()),
            ("--swa-keep-window", args.swa_keep_window),
        ]
        .into_iter()
        .find(|(_, g)| *g)
        .map(|(f, _)| f);
        match (args.model, swa_flag) {
            (None, Some(_)) => Ok(Model::Swa),
            (Some(m), Some(flag)) if m != Model::Swa => {
                Err(ReplayError::Config(format!("{flag} is an option of --model swa, not --model {}", m.name())))
            }
            (m, _) => Ok(m.unwrap_or_default()),
        }
    }

    /// The SWA options (see [`model_of`] for when they apply).
    fn swa_config(args: &ReplayArgs) -> Result<SwaConfig, ReplayError> {
        let d = SwaConfig::default();
        let ratio_permille = match args.swa_ratio {
            None => d.ratio_permille,
            Some(r) if r.is_finite() && (0.001..=1.0).contains(&r) => (r * 1000.0).round() as u32,
            Some(r) => return Err(ReplayError::Config(format!("--swa-ratio must be between 0.001 and 1, not {r}"))),
        };
        Ok(SwaConfig { window: args.swa_window.unwrap_or(d.window), ratio_permille, release: !args.swa_keep_window })
    }

    fn parse_write_policy(s: &str) -> Result<WritePolicy, String> {
        WritePolicy::from_name(s)
            .ok_or_else(|| format!("expected write_through, write_through_selective or write_back, not {s}"))
    }

    /// The engines and their store (`--engines`, `--store` and their options).
    fn engines_config(args: &ReplayArgs) -> Result<EnginesConfig, ReplayError> {
        let d = EnginesConfig::default();
        let store = match &args.store {
            Some(urls) => {
                let mut s = StoreTierConfig::new(String::new());
                s.nodes = urls.split(',').map(|u| u.trim().to_string()).collect();
                s.cluster = args.store_cluster || s.nodes.len() > 1;
                if let Some(b) = args.store_bytes_per_token {
                    s.bytes_per_token = b;
                }
                if let Some(ms) = args.store_timeout_ms {
                    s.timeout = std::time::Duration::from_millis(ms);
                }
                Some(s)
            }
            None => {
                let flag = [
                    ("--store-cluster", args.store_cluster),
                    ("--store-bytes-per-token", args.store_bytes_per_token.is_some()),
                    ("--store-timeout-ms", args.store_timeout_ms.is_some()),
                ]
                .into_iter()
                .find(|(_, g)| *g);
                if let Some((flag, _)) = flag {
                    return Err(ReplayError::Config(format!("{flag} is an option of --store")));
                }
                None
            }
        };
        // The router's options would be ignored without engines to route to, and
        // --route-tokens with any router but the prefix one.
        if args.engines.is_none() && args.store.is_none() {
            let given = [("--router", args.router.is_some()), ("--route-tokens", args.route_tokens.is_some())];
            if let Some((flag, _)) = given.into_iter().find(|(_, g)| *g) {
                return Err(ReplayError::Config(format!("{flag} is an option of --engines (or --store)")));
            }
        } else if args.route_tokens.is_some() && args.router != Some(Router::Prefix) {
            return Err(ReplayError::Config("--route-tokens is an option of --router prefix".into()));
        }
        Ok(EnginesConfig {
            engines: args.engines.unwrap_or(d.engines),
            router: args.router.unwrap_or(d.router),
            route_tokens: args.route_tokens.unwrap_or(d.route_tokens),
            store,
        })
    }

    /// The host tier, when one of its options is given (or `--engines` / `--store`,
    /// which need one).
    fn host_config(args: &ReplayArgs) -> Result<Option<HostTierConfig>, ReplayError> {
        let any = args.engines.is_some()
            || args.store.is_some()
            || args.host_capacity_tokens.is_some()
            || args.host_ratio.is_some()
            || args.write_policy.is_some()
            || args.transfer_bytes_per_token.is_some()
            || args.link_gbps.is_some();
        if !any {
            return Ok(None);
        }
        let tokens = match (args.host_capacity_tokens, args.host_ratio) {
            (Some(n), _) => n,
            (None, Some(r)) if r.is_finite() && r > 0.0 && r * args.capacity_tokens as f64 <= usize::MAX as f64 => {
                let tokens = (r * args.capacity_tokens as f64) as usize;
                // Named here: the tier's own check would name --host-capacity-tokens.
                if tokens < args.page_size as usize {
                    return Err(ReplayError::Config(format!(
                        "--host-ratio {r} makes a host tier of {tokens} tokens (of --capacity-tokens {}), less than \
                         one page of {} tokens",
                        args.capacity_tokens, args.page_size
                    )));
                }
                tokens
            }
            (None, Some(r)) if r.is_finite() && r > 0.0 => {
                return Err(ReplayError::Config(format!(
                    "--host-ratio {r:e} is too large: the host tier of {r:e} x --capacity-tokens {} tokens does not \
                     fit in {} bits",
                    args.capacity_tokens,
                    usize::BITS
                )))
            }
            (None, Some(r)) => {
                return Err(ReplayError::Config(format!("--host-ratio must be a positive number, not {r}")))
            }
            (None, None) => (replay::DEFAULT_HOST_TO_DEVICE_RATIO * args.capacity_tokens as f64) as usize,
        };
        let mut host = HostTierConfig::new(tokens);
        if let Some(p) = args.write_policy {
            host.write_policy = p;
        }
        if let Some(b) = args.transfer_bytes_per_token {
            host.bytes_per_token = b;
        }
        if let Some(g) = args.link_gbps {
            if !(g.is_finite() && g > 0.0) {
                return Err(ReplayError::Config(format!("--link-gbps must be a positive number, not {g}")));
            }
            if g * 1e9 > u64::MAX as f64 {
                return Err(ReplayError::Config(format!(
                    "--link-gbps {g:e} is too large: at most {:e} (bytes per second must fit in 64 bits)",
                    u64::MAX as f64 / 1e9
                )));
            }
            host.link_bytes_per_second = ((g * 1e9) as u64).max(1);
        }
        Ok(Some(host))
    }

    fn run_replay(args: ReplayArgs) -> Result<(), Failure> {
        if args.limit == Some(0) {
            return Err(ReplayError::Config("--limit must be at least 1".into()).into());
        }
        let model = model_of(&args)?;
        let hybrid = hybrid_config(&args, model)?;
        let swa = swa_config(&args)?;
        let host = host_config(&args)?;
        let engines = engines_config(&args)?;
        let optimal = matches!(args.policy, PolicyArg::Offline(_));
        if optimal && args.plot.is_some() {
            return Err(ReplayError::Config(
                "--plot is not available with --policy optimal or oracle-return (the offline model keeps no timeline)"
                    .into(),
            )
            .into());
        }
        let default_mode = if matches!(model, Model::Hybrid | Model::Swa) || optimal || host.is_some() {
            Mode::Sequential
        } else {
            Mode::Overlap
        };
        let default_cache = CacheKind::Kvpool;
        let config = ReplayConfig {
            capacity_tokens: args.capacity_tokens,
            page_size: args.page_size,
            policy: match args.policy {
                PolicyArg::Cache(p) => p,
                PolicyArg::Offline(_) => EvictionPolicy::Lru,
            },
            lookahead: args.lookahead,
            partial_evict: args.partial_evict,
            optimal,
            ceiling: match args.policy {
                PolicyArg::Offline(c) => c,
                PolicyArg::Cache(_) => Ceiling::Optimal,
            },
            mode: args.mode.unwrap_or(default_mode),
            cache: args.cache.unwrap_or(default_cache),
            max_running: args.max_running,
            routers: args.routers,
            timeline: args.plot.is_some(),
            model,
            hybrid,
            swa,
            host,
            engines,
        };
        let mut trace = match &args.trace {
            Some(path) => Trace::from_path(path).map_err(ReplayError::from)?,
            None => Trace::bundled().map_err(ReplayError::from)?,
        };
        if let Some(limit) = args.limit {
            trace.truncate(limit);
        }
        config.validate(&trace)?;
        // Fail now rather than after the replay if the plot cannot be written there.
        let plot = args.plot.as_deref().map(PlotFile::create).transpose()?;

        let bar = if args.json || !std::io::stderr().is_terminal() {
            ProgressBar::hidden()
        } else {
            let bar = ProgressBar::with_draw_target(Some(trace.len() as u64), ProgressDrawTarget::stderr());
            if let Ok(style) =
                ProgressStyle::with_template("{spinner} replay [{elapsed_precise}] {wide_bar} {pos}/{len} requests")
            {
                bar.set_style(style);
            }
            bar
        };
        let report = replay::replay(&trace, &config, &|done| bar.set_position(done));
        bar.finish_and_clear();
        let report = report?;

        let mut text = String::new();
        if args.json {
            let _ = writeln!(text, "{}", report.to_json());
        } else {
            let _ = writeln!(text, "trace: {} ({} requests)", trace.source(), trace.len());
            let _ = writeln!(text, "{report}");
        }
        // The plot first: if it fails, the run fails with nothing printed on stdout.
        if let Some(plot) = plot {
            let path = plot.target.clone();
            plot.finish(&report)?;
            if !args.json {
                let _ = writeln!(text, "plot written to {}", path.display());
            }
        }
        print(&text)?;
        Ok(())
    }
}

#[cfg(not(loom))]
fn main() -> std::process::ExitCode {
    cli::main()
}

/// Under `--cfg loom` kvpool's atomics are loom's, which only work inside a loom
/// model: the tool is not built.
#[cfg(loom)]
fn main() -> std::process::ExitCode {
    eprintln!("kvpool was built with --cfg loom (for model checking); the command-line tool is not available");
    std::process::ExitCode::FAILURE
}
