//! The check's tally: one line per case (name, outputs, differing bits) and
//! the summary line `scripts/device-check.sh` reads ("… cases
//! bit-identical …"), with the exit status: 0 only when every case is
//! bit-identical and every negative control was seen.

/// Cases run and cases with a differing bit.
#[derive(Default)]
pub struct Report {
    cases: usize,
    bad: usize,
}

impl Report {
    /// One case: `d` differing bits among `of` outputs.
    pub fn case(&mut self, name: String, d: usize, of: usize) {
        self.cases += 1;
        if d > 0 {
            self.bad += 1;
        }
        println!("{:<58} {:>9} outputs  {:>6} differing bits", name, of, d);
    }

    /// Prints the summary (and the controls the check could not see,
    /// `blind`) and returns the exit status.
    pub fn finish(&self, isa: impl std::fmt::Debug, device: &str, blind: &[&str]) -> i32 {
        println!(
            "summary: {} of {} cases bit-identical (CPU ISA {:?} vs {})",
            self.cases - self.bad,
            self.cases,
            isa,
            device
        );
        if !blind.is_empty() {
            println!(
                "the check cannot see {} negative control(s): {}",
                blind.len(),
                blind.join("; ")
            );
        }
        if self.bad == 0 && blind.is_empty() {
            0
        } else {
            1
        }
    }
}
