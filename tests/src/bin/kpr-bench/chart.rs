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
