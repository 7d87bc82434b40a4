use anyhow::Result;
#[derive(clap::Args, Debug)]
pub struct BenchArgs {}
pub fn run(_a: &BenchArgs) -> Result<()> {
    Ok(())
}
