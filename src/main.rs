//! `kvpool`: the command-line tool.
//!
//! `kvpool replay` replays a request trace (by default the bundled Mooncake
//! conversation trace) through kvpool's allocators, request rows and prefix cache, the
//! way an inference engine's scheduler drives them, and reports hit rate, memory use,
//! throughput and latency. See `kvpool replay --help`.

#[cfg(not(loom))]
mod cli {
    use std::io::IsTerminal;
    use std::path::PathBuf;
    use std::process::ExitCode;

    use clap::{Args, Parser, Subcommand};
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    use kvpool::radix::EvictionPolicy;
    use kvpool::replay::{self, CacheKind, Mode, ReplayConfig, ReplayError, Trace};

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

    #[derive(Args)]
    struct ReplayArgs {
        /// JSON-lines trace in the Mooncake format (plain or gzip); default: the
        /// bundled Mooncake conversation trace.
        #[arg(long, value_name = "PATH")]
        trace: Option<PathBuf>,
        /// Token capacity of the KV pool.
        #[arg(long, value_name = "N", default_value_t = replay::DEFAULT_CAPACITY_TOKENS)]
        capacity_tokens: usize,
        /// Tokens per page.
        #[arg(long, value_name = "P", default_value_t = replay::DEFAULT_PAGE_SIZE)]
        page_size: u32,
        /// Eviction policy: lru, lfu, fifo, mru, filo or priority.
        #[arg(long, default_value = "lru")]
        policy: EvictionPolicy,
        /// sequential (one request at a time, deterministic) or overlap (scheduler,
        /// output and router threads at once).
        #[arg(long, default_value = "overlap")]
        mode: Mode,
        /// Requests running at once (overlap mode).
        #[arg(long, value_name = "R", default_value_t = replay::DEFAULT_MAX_RUNNING)]
        max_running: usize,
        /// Router threads matching upcoming prompts read-only (overlap mode).
        #[arg(long, value_name = "K", default_value_t = replay::DEFAULT_ROUTERS)]
        routers: usize,
        /// Which prefix cache to drive: kvpool (the concurrent RadixCache), reference
        /// (the simple single-threaded tree behind a mutex) or vectrie (the TGI-style
        /// trie behind a mutex).
        #[arg(long, default_value = "kvpool")]
        cache: CacheKind,
        /// Print one JSON object on stdout instead of the table.
        #[arg(long)]
        json: bool,
        /// Replay only the first N requests.
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
        /// Draw cache occupancy and cumulative hit rate against request index into an
        /// SVG file.
        #[arg(long, value_name = "FILE.svg")]
        plot: Option<PathBuf>,
    }

    pub fn main() -> ExitCode {
        let cli = Cli::parse();
        let result = match cli.command {
            Command::Replay(args) => run_replay(args),
        };
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        }
    }

    fn run_replay(args: ReplayArgs) -> Result<(), ReplayError> {
        if args.limit == Some(0) {
            return Err(ReplayError::Config("--limit must be at least 1".into()));
        }
        let config = ReplayConfig {
            capacity_tokens: args.capacity_tokens,
            page_size: args.page_size,
            policy: args.policy,
            mode: args.mode,
            cache: args.cache,
            max_running: args.max_running,
            routers: args.routers,
            timeline: args.plot.is_some(),
        };
        let mut trace = match &args.trace {
            Some(path) => Trace::from_path(path)?,
            None => Trace::bundled()?,
        };
        if let Some(limit) = args.limit {
            trace.truncate(limit);
        }
        config.validate(&trace)?;
        if let Some(path) = &args.plot {
            // Fail now rather than after the replay: the file is written at the end.
            std::fs::File::create(path).map_err(|e| ReplayError::Plot(format!("{}: {e}", path.display())))?;
        }

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

        if args.json {
            println!("{}", report.to_json());
        } else {
            println!("trace: {} ({} requests)", trace.source(), trace.len());
            println!("{report}");
        }
        if let Some(path) = &args.plot {
            replay::write_plot(&report, path)?;
            if !args.json {
                println!("plot written to {}", path.display());
            }
        }
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
