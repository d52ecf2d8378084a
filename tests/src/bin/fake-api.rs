//! The test suite's fake Messages API as a process of its own, for benchmarks that drive the
//! real Claude Code CLI offline (`tools/bench-continue`): it prints its base URL on one line
//! and serves on loopback until its standard input closes.

use std::io::{Read, Write};

fn main() {
    let fake = flotilla_tests::fake_anthropic::FakeAnthropic::start();
    println!("{}", fake.base_url());
    let _ = std::io::stdout().flush();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}
