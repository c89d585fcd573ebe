//! `--plot`: cache occupancy and cumulative hit rate against request index, as SVG.

use std::path::Path;

use plotters::prelude::*;

use super::{ReplayError, Report, TimelinePoint};

/// The most points drawn per line; longer timelines are thinned evenly.
const MAX_POINTS: usize = 2000;

fn thin(timeline: &[TimelinePoint]) -> impl Iterator<Item = &TimelinePoint> {
    let step = timeline.len().div_ceil(MAX_POINTS).max(1);
    let last = timeline.len().saturating_sub(1);
    timeline.iter().enumerate().filter(move |(i, _)| i % step == 0 || *i == last).map(|(_, p)| p)
}

/// Draw the report's timeline into an SVG file: KV slots in use and tokens cached
/// (top, in thousands of tokens, with the capacity as a line) and the cumulative hit
/// rate (bottom), against the number of requests done.
///
/// # Examples
///
/// ```
/// use kvpool::replay::{replay, write_plot, Mode, ReplayConfig, Trace};
/// let text = "{\"input_length\": 600, \"output_length\": 10, \"hash_ids\": [1, 2]}\n".repeat(3);
/// let trace = Trace::from_jsonl_str(&text, "example")?;
/// let config = ReplayConfig { mode: Mode::Sequential, timeline: true, ..ReplayConfig::default() };
/// let report = replay(&trace, &config, &|_| {})?;
/// let path = std::env::temp_dir().join(format!("kvpool-doc-plot-{}.svg", std::process::id()));
/// write_plot(&report, &path)?;
/// assert!(std::fs::read_to_string(&path)?.starts_with("<svg"));
/// # std::fs::remove_file(&path)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
///
/// [`ReplayError::Plot`] if the report has no timeline (the replay ran without
/// [`ReplayConfig::timeline`](super::ReplayConfig::timeline)) or the file cannot be
/// written.
pub fn write_plot(report: &Report, path: &Path) -> Result<(), ReplayError> {
    if report.timeline.is_empty() {
        return Err(ReplayError::Plot("the replay recorded no timeline (no request was served)".into()));
    }
    draw(report, path).map_err(|e| ReplayError::Plot(format!("{}: {e}", path.display())))
}

fn draw(report: &Report, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let timeline = &report.timeline;
    let x_max = timeline.last().map_or(1, |p| p.requests_done).max(1) as f64;
    let k = |t: u64| t as f64 / 1000.0;
    let y_max = k(report.capacity_tokens.max(report.peak_used_tokens).max(1)) * 1.05;

    // A hybrid replay adds a third panel: the Mamba state pool; a two-tier replay one
    // for the host pool.
    let hybrid = report.hybrid.as_ref().filter(|h| h.timeline.len() == timeline.len());
    let host = report.host.as_ref();
    let height = if hybrid.is_some() || host.is_some() { 1040 } else { 720 };
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(400);
    let (bottom, states) = bottom.split_vertically(320);
    let title = format!(
        "kvpool replay: {} mode, {} cache, {}, page size {}",
        report.mode, report.cache, report.policy, report.page_size
    );

    let mut chart = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc("requests done")
        .y_desc("thousands of tokens")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    let capacity = k(report.capacity_tokens);
    chart
        .draw_series(LineSeries::new([(0.0, capacity), (x_max, capacity)], BLACK.mix(0.5)))?
        .label("capacity")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.mix(0.5)));
    chart
        .draw_series(LineSeries::new(thin(timeline).map(|p| (p.requests_done as f64, k(p.used_tokens))), &RED))?
        .label("KV slots in use")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RED));
    chart
        .draw_series(LineSeries::new(thin(timeline).map(|p| (p.requests_done as f64, k(p.cached_tokens))), &BLUE))?
        .label("tokens cached")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;

    let rate = |p: &TimelinePoint| {
        if p.prompt_tokens == 0 {
            0.0
        } else {
            100.0 * p.hit_tokens as f64 / p.prompt_tokens as f64
        }
    };
    let kv_rate = |(p, h): (&TimelinePoint, &super::HybridPoint)| {
        if p.prompt_tokens == 0 {
            0.0
        } else {
            100.0 * h.kv_hit_tokens as f64 / p.prompt_tokens as f64
        }
    };
    // Scale to the rates seen (a 5% hit rate is a flat line on a 0-100 axis).
    let mut rate_max = timeline.iter().map(rate).fold(0.0, f64::max);
    if let Some(h) = hybrid {
        rate_max = timeline.iter().zip(&h.timeline).map(kv_rate).fold(rate_max, f64::max);
    }
    let y_max = (rate_max * 1.25).clamp(1.0, 100.0).ceil();
    let mut chart = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc("requests done")
        .y_desc("cumulative hit rate, %")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    let label = if hybrid.is_some() {
        "state hit rate: resumable"
    } else if host.is_some() {
        "hit rate, device + host"
    } else {
        "hit rate"
    };
    chart
        .draw_series(LineSeries::new(thin(timeline).map(|p| (p.requests_done as f64, rate(p))), &GREEN))?
        .label(format!("{label} (final {:.2}%)", report.hit_rate * 100.0))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], GREEN));
    if let Some(h) = hybrid {
        let points: Vec<(f64, f64)> =
            thin_pairs(timeline, &h.timeline).map(|(p, q)| (p.requests_done as f64, kv_rate((p, q)))).collect();
        chart
            .draw_series(LineSeries::new(points, &MAGENTA))?
            .label(format!("KV hit rate (final {:.2}%)", h.kv_hit_rate * 100.0))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], MAGENTA));
    }
    if let Some(h) = host {
        let host_rate = |p: &TimelinePoint| {
            if p.prompt_tokens == 0 {
                0.0
            } else {
                100.0 * p.host_hit_tokens as f64 / p.prompt_tokens as f64
            }
        };
        chart
            .draw_series(LineSeries::new(thin(timeline).map(|p| (p.requests_done as f64, host_rate(p))), &MAGENTA))?
            .label(format!("loaded back from host (final {:.2}%)", h.host_hit_rate * 100.0))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], MAGENTA));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    if let Some(h) = hybrid {
        draw_states(&states, x_max, timeline, h)?;
    } else if let Some(h) = host {
        draw_host(&states, x_max, timeline, h)?;
    }
    root.present()?;
    Ok(())
}

/// The two-tier panel: host tokens held against the host pool's size.
fn draw_host<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    x_max: f64,
    timeline: &[TimelinePoint],
    h: &super::HostReport,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let k = |t: u64| t as f64 / 1000.0;
    let capacity = k(h.host_capacity_tokens as u64);
    let peak = timeline.iter().map(|p| p.host_tokens).max().unwrap_or(0);
    let held: Vec<(f64, f64)> = thin(timeline).map(|p| (p.requests_done as f64, k(p.host_tokens))).collect();
    pool_panel(
        area,
        x_max,
        capacity.max(k(peak)),
        "host tier, thousands of tokens",
        (capacity, format!("host pool ({})", h.write_policy)),
        [(held, "tokens held in host memory".to_string(), BLUE)],
    )
}

/// One line of a panel: its points, its label, its colour.
type Series = (Vec<(f64, f64)>, String, RGBColor);

/// A pool panel: the pool's size as a grey line and `series` against requests done,
/// the y axis up to `y_peak` (and 5% above).
fn pool_panel<DB: DrawingBackend, const N: usize>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    x_max: f64,
    y_peak: f64,
    y_desc: &str,
    (capacity, capacity_label): (f64, String),
    series: [Series; N],
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let y_max = y_peak.max(1.0) * 1.05;
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc("requests done")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    chart
        .draw_series(LineSeries::new([(0.0, capacity), (x_max, capacity)], BLACK.mix(0.5)))?
        .label(capacity_label)
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.mix(0.5)));
    for (points, label, color) in series {
        chart
            .draw_series(LineSeries::new(points, color))?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// [`thin`] over the timeline and the hybrid timeline together.
fn thin_pairs<'a>(
    timeline: &'a [TimelinePoint],
    hybrid: &'a [super::HybridPoint],
) -> impl Iterator<Item = (&'a TimelinePoint, &'a super::HybridPoint)> {
    let step = timeline.len().div_ceil(MAX_POINTS).max(1);
    let last = timeline.len().saturating_sub(1);
    timeline.iter().zip(hybrid).enumerate().filter(move |(i, _)| i % step == 0 || *i == last).map(|(_, p)| p)
}

/// The hybrid panel: Mamba state slots in use and cached, against the pool's size.
fn draw_states<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    x_max: f64,
    timeline: &[TimelinePoint],
    h: &super::HybridReport,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let capacity = h.mamba_states as f64;
    let series = |f: fn(&super::HybridPoint) -> u64| {
        thin_pairs(timeline, &h.timeline).map(|(p, q)| (p.requests_done as f64, f(q) as f64)).collect::<Vec<_>>()
    };
    pool_panel(
        area,
        x_max,
        capacity.max(h.peak_states_in_use as f64),
        "Mamba state slots",
        (capacity, "state pool".to_string()),
        [
            (series(|q| q.states_in_use), "states in use".to_string(), RED),
            (
                series(|q| q.states_cached),
                format!("states cached ({} tombstones at the end)", h.final_tombstones),
                BLUE,
            ),
        ],
    )
}
