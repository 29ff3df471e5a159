//! The README's chart, drawn from the bench's JSON: NodePort connection rate and full-sync time
//! against the number of Services, kpr beside the real kube-proxy (plotters, SVG).
use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

const SERIES: [(&str, RGBColor); 4] = [
    ("direct", RGBColor(120, 120, 120)),
    ("kpr", RGBColor(31, 119, 180)),
    ("kube-proxy-iptables", RGBColor(214, 39, 40)),
    ("kube-proxy-nftables", RGBColor(255, 127, 14)),
];

/// (services, value) points of `series`, from `vs_kube_proxy.sizes.*` via `value`.
fn points(result: &serde_json::Value, value: impl Fn(&serde_json::Value) -> Option<f64>) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = result["vs_kube_proxy"]["sizes"]
        .as_object()
        .map(|sizes| sizes.iter().filter_map(|(size, v)| Some((size.parse().ok()?, value(v)?))).collect())
        .unwrap_or_default();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// A line per path: (name, colour, (services, value) points).
type Series = (&'static str, RGBColor, Vec<(f64, f64)>);

pub fn write(result: &serde_json::Value, path: &Path) -> Result<()> {
    let caption = format!(
        "kpr vs kube-proxy — commit {}, Linux {}, {} CPUs",
        result["measured_on"]["commit"].as_str().unwrap_or("?"),
        result["measured_on"]["kernel"].as_str().unwrap_or("?"),
        result["measured_on"]["cpus"]
    );
    let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let root = root.titled(&caption, ("sans-serif", 16)).map_err(|e| anyhow!("{e}"))?;
    let (left, right) = root.split_horizontally(480);

    let rates: Vec<Series> = SERIES
        .iter()
        .map(|(name, color)| (*name, *color, points(result, |v| v["node_port"][*name]["conn_per_s"].as_f64())))
        .collect();
    let syncs: Vec<Series> = SERIES[1..]
        .iter()
        .map(|(name, color)| {
            let mut pts: Vec<(f64, f64)> = result["vs_kube_proxy"]["full_sync_s"]
                .as_object()
                .map(|sizes| {
                    sizes.iter().filter_map(|(size, v)| Some((size.parse().ok()?, v[*name].as_f64()?))).collect()
                })
                .unwrap_or_default();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (*name, *color, pts)
        })
        .collect();
    let max_services = rates.iter().flat_map(|(_, _, p)| p.iter().map(|x| x.0)).fold(1.0, f64::max);
    panel(
        &left,
        "NodePort connections/s (external client)",
        "conn/s",
        &rates,
        max_services,
        SeriesLabelPosition::LowerLeft,
    )?;
    panel(&right, "Full sync from a cold start (s)", "seconds", &syncs, max_services, SeriesLabelPosition::UpperLeft)?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// One chart: a line per series against the number of Services.
fn panel(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    caption: &str,
    y_desc: &str,
    series: &[Series],
    max_services: f64,
    legend: SeriesLabelPosition,
) -> Result<()> {
    let max_y = series.iter().flat_map(|(_, _, p)| p.iter().map(|x| x.1)).fold(0.1, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 14))
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..max_services * 1.05, 0.0..max_y * 1.15)
        .map_err(|e| anyhow!("{e}"))?;
    chart.configure_mesh().x_desc("Services (× 4 endpoints)").y_desc(y_desc).draw().map_err(|e| anyhow!("{e}"))?;
    for (name, color, pts) in series {
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)).point_size(3))
            .map_err(|e| anyhow!("{e}"))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(legend)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// `--scale`'s chart: per shape, kpr's API write → traffic p99 (idle, under churn) and its
/// full and restart sync, with kube-proxy's where it finished (bars, SVG).
pub fn write_scale(result: &serde_json::Value, path: &Path) -> Result<()> {
    let Some(shapes) = result["shapes"].as_object() else { return Ok(()) };
    let mut shapes: Vec<(&String, &serde_json::Value)> = shapes.iter().collect();
    // By endpoints in all, then Services.
    let size = |v: &serde_json::Value| {
        let n = |k: &str| v[k].as_f64().unwrap_or(0.0);
        (n("services") * n("endpoints_per_service"), n("services"))
    };
    shapes.sort_by(|a, b| size(a.1).partial_cmp(&size(b.1)).unwrap_or(std::cmp::Ordering::Equal));
    let commit = shapes.iter().find_map(|(_, v)| v["measured_on"]["commit"].as_str()).unwrap_or("?");
    let kernel = shapes.iter().find_map(|(_, v)| v["measured_on"]["kernel"].as_str()).unwrap_or("?");
    let caption = format!("kpr at scale — commit {commit}, Linux {kernel}, real kube-apiserver, minSyncPeriod 10 ms");
    let root = SVGBackend::new(path, (960, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let root = root.titled(&caption, ("sans-serif", 16)).map_err(|e| anyhow!("{e}"))?;
    let (left, right) = root.split_horizontally(480);
    let labels: Vec<String> = shapes.iter().map(|(name, _)| name.replace('x', " × ")).collect();
    let bars = |pick: &dyn Fn(&serde_json::Value) -> Option<f64>| -> Vec<f64> {
        shapes.iter().map(|(_, v)| pick(v).unwrap_or(0.0)).collect()
    };
    let latency = [
        ("idle p99", SERIES[1].1, bars(&|v| v["api_to_traffic_ms"]["idle"]["p99"].as_f64())),
        ("100 changes/s p99", SERIES[3].1, bars(&|v| v["api_to_traffic_ms"]["under_churn"]["p99"].as_f64())),
    ];
    let sync = [
        ("full sync", SERIES[1].1, bars(&|v| v["full_sync_s"].as_f64())),
        ("restart", SERIES[0].1, bars(&|v| v["restart_sync_s"].as_f64())),
        ("nftables full sync", SERIES[2].1, bars(&|v| v["kube_proxy_nftables"]["full_sync_s"].as_f64())),
    ];
    bar_panel(&left, "API write → traffic moving, kpr (ms)", &labels, &latency)?;
    bar_panel(&right, "Full sync (s)", &labels, &sync)?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// Grouped bars: one group per label, one bar per series.
fn bar_panel(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    caption: &str,
    labels: &[String],
    series: &[(&str, RGBColor, Vec<f64>)],
) -> Result<()> {
    let max_y = series.iter().flat_map(|(_, _, v)| v.iter().copied()).fold(0.1, f64::max);
    let groups = labels.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 14))
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5..groups - 0.5, 0.0..max_y * 1.15)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(labels.len())
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 0.01 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    let width = 0.8 / series.len().max(1) as f64;
    for (k, (name, color, values)) in series.iter().enumerate() {
        let left = |i: usize| i as f64 - 0.4 + k as f64 * width;
        chart
            .draw_series(
                values
                    .iter()
                    .enumerate()
                    .map(|(i, v)| Rectangle::new([(left(i), 0.0), (left(i) + width, *v)], color.filled())),
            )
            .map_err(|e| anyhow!("{e}"))?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
